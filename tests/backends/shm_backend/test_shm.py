"""The shm backend in one process: the conformance suite, LRU eviction and limits, the
segment's lifetime and its file's checks, configuration. Several processes on one segment are
``test_shm_processes.py``."""

from __future__ import annotations

import hashlib
import pathlib
import sys
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from shm_kit import KIB, MIB, SHM_DIR, fresh_name, opened_small, pattern, shm_config

from hicache.backends.base import StorageBackend
from hicache.backends.registry import open_backend
from hicache.backends.shm import SharedMemoryBackend, SharedMemoryConfig
from hicache.backends.shm.copies import split_batch
from hicache.backends.shm.index import key_hash
from hicache.backends.shm.layout import Hdr
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import BackendUnavailableError, ConfigError

name = pytest.fixture(fresh_name, name="name")
small = pytest_asyncio.fixture(opened_small, name="small")


def _name_for(location: pathlib.Path) -> str:
    return "test-" + hashlib.sha256(str(location).encode()).hexdigest()[:20]


class TestShmConformance(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        config = SharedMemoryConfig(
            name=_name_for(location),
            capacity_bytes=160 * MIB,  # twice the suite's 64 MiB object, plus room
            block_bytes=64 * KIB,
            directory=SHM_DIR,
        )
        return await SharedMemoryBackend.open(config)

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        SharedMemoryBackend.unlink_segment(_name_for(location), SHM_DIR)

    # Raw hooks: the segment's index says where a key's blocks are; the bytes are read from and
    # written to the shared data area directly, as another process attached to it would.
    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        assert isinstance(backend, SharedMemoryBackend)
        index, raw = backend._index, key.encode()
        with index.locked():
            ticket = index.open_read(raw, key_hash(raw))
            if ticket is None:
                return None
            return b"".join(bytes(backend._data[off : off + n]) for off, n in ticket.extents)

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        assert isinstance(backend, SharedMemoryBackend)
        index, raw, source = backend._index, key.encode(), np.frombuffer(data, np.uint8)
        with index.locked():
            ticket = index.reserve(raw, key_hash(raw), len(data))
        assert ticket is not None
        done = 0
        for off, n in ticket.extents:
            backend._data[off : off + n] = source[done : done + n]
            done += n
        with index.locked():
            assert index.publish(ticket)


# ----- eviction and limits ----------------------------------------------------------------------
async def test_lru_eviction_order(name: str) -> None:
    backend = await SharedMemoryBackend.open(
        shm_config(name, capacity_bytes=16 * KIB, block_bytes=4 * KIB)
    )
    try:
        block = 4 * KIB
        assert await backend.put(["a", "b", "c", "d"], [b"a" * block] * 4) == [True] * 4
        assert await backend.get_into(["a"], [bytearray(block)]) == [block]  # a: most recent
        assert await backend.put(["e"], [b"e" * block]) == [True]
        assert await backend.exists(["a", "b", "c", "d", "e"]) == [True, False, True, True, True]
        assert await backend.exists(["c"]) == [True]  # exists() does not count as a use
        assert await backend.put(["big"], [b"B" * (2 * block)]) == [True]  # c and d go
        assert await backend.exists(["a", "c", "d", "e", "big"]) == [True, False, False, True, True]
        stats = await backend.stats()
        assert (stats["evictions"], stats["objects"], stats["used_bytes"]) == (3, 3, 4 * block)
    finally:
        await backend.close()


async def test_max_objects_bounds_the_count(name: str) -> None:
    backend = await SharedMemoryBackend.open(shm_config(name, max_objects=2))
    try:
        assert await backend.put(["x", "y", "z"], [b"1", b"2", b"3"]) == [True] * 3
        assert await backend.exists(["x", "y", "z"]) == [False, True, True]
        assert await backend.put(["empty"], [b""]) == [True]  # no blocks, still an entry
        assert (await backend.stats())["objects"] == 2
    finally:
        await backend.close()


async def test_batch_larger_than_capacity_keeps_the_last(small: SharedMemoryBackend) -> None:
    values = [pattern(i, 1 * MIB) for i in range(6)]
    keys = [f"obj-{i}" for i in range(6)]
    assert await small.put(keys, values) == [True] * 6
    assert await small.exists(keys) == [False, False, True, True, True, True]
    assert await small.get(keys[2:]) == values[2:]


async def test_object_larger_than_capacity_is_refused(small: SharedMemoryBackend) -> None:
    assert small.capabilities.max_object_bytes == 4 * MIB
    assert small.capabilities.shared_across_processes and not small.capabilities.persistent
    assert await small.put(["ok", "huge"], [b"fine", bytes(4 * MIB + 1)]) == [True, False]
    stats = await small.stats()
    assert (stats["put_too_large"], stats["put_failures"], stats["objects"]) == (1, 1, 1)


async def test_large_batches_split_across_threads(name: str) -> None:
    backend = await SharedMemoryBackend.open(shm_config(name, capacity_bytes=96 * MIB))
    try:
        values = [np.full(4 * MIB, i, np.uint8) for i in range(8)]
        keys = [f"part-{i}" for i in range(8)]
        assert len(split_batch([4 * MIB] * 8, backend.config.parallel_copies)) == 2
        assert await backend.put(keys, values) == [True] * 8
        outs = [np.zeros(4 * MIB, np.uint8) for _ in range(8)]
        assert await backend.get_into(keys, outs) == [4 * MIB] * 8
        assert all(np.array_equal(o, v) for o, v in zip(outs, values, strict=True))
    finally:
        await backend.close()


def test_split_balances_bytes() -> None:
    assert split_batch([1] * 10, 4) == [range(10)]  # too small to be worth a thread
    parts = split_batch([8 * MIB] * 6, 3)
    assert parts == [range(0, 2), range(2, 4), range(4, 6)]
    parts = split_batch([64 * MIB, 1, 1, 1], 2)
    assert [list(p) for p in parts] == [[0], [1, 2, 3]]
    assert split_batch([], 4) == [range(0)]


# ----- lifetime and the segment file ------------------------------------------------------------
async def test_unlink_then_open_gives_a_fresh_segment(name: str) -> None:
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    backend = await SharedMemoryBackend.open(shm_config(name))
    assert await backend.put(["k"], [b"v"]) == [True]
    assert path.exists()
    assert backend.unlink() is True
    assert not path.exists()
    assert await backend.get(["k"]) == [b"v"]  # attached processes keep their copy
    fresh = await SharedMemoryBackend.open(shm_config(name))
    try:
        assert await fresh.exists(["k"]) == [False]
        assert (await fresh.stats())["objects"] == 0
    finally:
        await fresh.close()
        await backend.close()
    assert SharedMemoryBackend.unlink_segment(name, SHM_DIR) is True
    assert SharedMemoryBackend.unlink_segment(name, SHM_DIR) is False


async def test_close_keeps_the_segment_unless_asked(name: str) -> None:
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    backend = await SharedMemoryBackend.open(shm_config(name))
    assert await backend.put(["k"], [b"kept"]) == [True]
    await backend.close()
    assert path.exists()
    backend = await SharedMemoryBackend.open(shm_config(name, unlink_on_close=True))
    assert await backend.get(["k"]) == [b"kept"]
    await backend.close()
    assert not path.exists()


async def test_attach_takes_the_stored_geometry(small: SharedMemoryBackend) -> None:
    attached = await SharedMemoryBackend.open(
        SharedMemoryConfig(name=small.config.name, directory=SHM_DIR)
    )
    try:
        assert (await attached.stats())["capacity_bytes"] == 4 * MIB
    finally:
        await attached.close()
    for mismatch in ({"capacity_bytes": 8 * MIB}, {"block_bytes": 128 * KIB}):
        with pytest.raises(ConfigError, match="exists with"):
            await SharedMemoryBackend.open(shm_config(small.config.name, **mismatch))


@pytest.mark.parametrize("content", [b"not a segment" * 100, b"abc"])
async def test_a_foreign_file_is_refused_and_kept(name: str, content: bytes) -> None:
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    path.write_bytes(content)
    with pytest.raises(BackendUnavailableError, match="not a hicache shared memory segment"):
        await SharedMemoryBackend.open(shm_config(name))
    assert path.read_bytes() == content


async def test_a_segment_of_another_version_is_refused(name: str) -> None:
    backend = await SharedMemoryBackend.open(shm_config(name))
    await backend.close()
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    with path.open("r+b") as f:
        f.seek(8 * Hdr.VERSION)
        f.write((99).to_bytes(8, sys.byteorder))
    with pytest.raises(BackendUnavailableError, match="incompatible hicache version"):
        await SharedMemoryBackend.open(shm_config(name))


async def test_a_creator_that_died_before_the_magic_is_redone(name: str) -> None:
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    path.write_bytes(bytes(1 << 16))  # sized, but the magic (written last) never came
    backend = await SharedMemoryBackend.open(shm_config(name))
    try:
        assert await backend.put(["k"], [b"v"]) == [True]
        assert (await backend.stats())["capacity_bytes"] == 4 * MIB
    finally:
        await backend.close()


async def test_missing_directory_is_unavailable(tmp_path: pathlib.Path) -> None:
    config = SharedMemoryConfig(name="x", directory=str(tmp_path / "absent"), capacity_bytes=MIB)
    with pytest.raises(BackendUnavailableError, match="directory"):
        await SharedMemoryBackend.open(config)


async def test_other_directory_and_url(tmp_path: pathlib.Path) -> None:
    url = f"shm://via-url?capacity_bytes=1M&block_bytes=64K&directory={tmp_path}"
    backend = await open_backend(url)
    try:
        assert isinstance(backend, SharedMemoryBackend)
        assert await backend.put(["k"], [b"v"]) == [True]
        assert (tmp_path / "hicache-via-url.shm").exists()
        assert (await backend.stats())["capacity_bytes"] == MIB
    finally:
        await backend.close()


@pytest.mark.parametrize(
    "bad", ["", "a/b", "..", "a..b", ".hidden", "-flag", "sp ace", "é", "x" * 129]
)
def test_bad_segment_names_raise(bad: str) -> None:
    with pytest.raises(ConfigError):
        SharedMemoryConfig(name=bad)
    with pytest.raises(ConfigError):
        SharedMemoryBackend.unlink_segment(bad)


@pytest.mark.parametrize(
    "fields",
    [
        {"block_bytes": 1000},
        {"block_bytes": 0},
        {"capacity_bytes": 1024},
        {"max_objects": 0},
        {"parallel_copies": 0},
        {"directory": "relative/dir"},
    ],
)
def test_bad_config_raises(fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SharedMemoryConfig(name="ok", **fields)


async def test_url_with_a_path_is_refused() -> None:
    with pytest.raises(ConfigError, match="no path"):
        await open_backend("shm://name/extra")
