"""The shm backend: the conformance suite, plus sharing across processes, dead writers, torn
reads, LRU eviction, unlink and the segment file's checks.

Child processes are started with ``sys.executable -c`` (a fresh interpreter, like spawn) and
talk back through their exit status and stdout.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import hicache.backends.shm.backend as shm_module
import hicache.backends.shm.layout as shm_layout
from hicache.backends.base import MISS, StorageBackend
from hicache.backends.registry import open_backend
from hicache.backends.shm import SharedMemoryBackend, SharedMemoryConfig
from hicache.backends.shm.copies import split_batch
from hicache.backends.shm.index import key_hash
from hicache.backends.shm.layout import Hdr
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import BackendUnavailableError, ConfigError

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
KIB = 1 << 10
MIB = 1 << 20


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


# ----- helpers ------------------------------------------------------------------------------------
@pytest.fixture
def name() -> Iterator[str]:
    """A fresh segment name, unlinked afterwards whatever the test did."""
    value = f"test-{uuid.uuid4().hex[:16]}"
    yield value
    SharedMemoryBackend.unlink_segment(value, SHM_DIR)


def _config(name: str, **fields: Any) -> SharedMemoryConfig:
    values: dict[str, Any] = {"capacity_bytes": 4 * MIB, "block_bytes": 64 * KIB}
    values.update(fields)
    return SharedMemoryConfig(name=name, directory=SHM_DIR, **values)


@pytest_asyncio.fixture
async def small(name: str) -> AsyncIterator[SharedMemoryBackend]:
    """A 4 MiB segment of 64 KiB blocks."""
    backend = await SharedMemoryBackend.open(_config(name))
    yield backend
    await backend.close()


_CHILD_PRELUDE = """
import asyncio, os, signal, sys
import numpy as np
from hicache.backends.shm import SharedMemoryBackend, SharedMemoryConfig
NAME, DIRECTORY = sys.argv[1], sys.argv[2]
def config():
    return SharedMemoryConfig(name=NAME, directory=DIRECTORY)
"""


def _run_child(body: str, name: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    code = _CHILD_PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, name, SHM_DIR],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _pattern(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size


# ----- sharing across processes -------------------------------------------------------------------
async def test_another_process_sees_objects_both_ways(small: SharedMemoryBackend) -> None:
    assert await small.put(["from-parent"], [_pattern(1, 100 * KIB)]) == [True]
    child = _run_child(
        """
        async def main():
            backend = await SharedMemoryBackend.open(config())
            got = await backend.get(["from-parent"])
            assert got == [bytes([1]) * (100 << 10)], "the child does not see the parent's put"
            assert await backend.put(["from-child"], [b"child!" * 1000]) == [True]
            print(sorted([i.key async for i in backend.scan("")]))
            await backend.close()
        asyncio.run(main())
        """,
        small.config.name,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "['from-child', 'from-parent']"
    assert await small.get(["from-child"]) == [b"child!" * 1000]
    assert (await small.stats())["objects"] == 2


async def test_second_instance_in_one_process_shares(small: SharedMemoryBackend) -> None:
    other = await SharedMemoryBackend.open(_config(small.config.name, capacity_bytes=None))
    try:
        assert await small.put(["k"], [b"v1"]) == [True]
        assert await other.get(["k"]) == [b"v1"]
        assert await other.delete(["k"]) == [True]
        assert await small.exists(["k"]) == [False]
    finally:
        await other.close()


# ----- dead writers -----------------------------------------------------------------------------
async def test_writer_killed_before_publishing_leaves_nothing_readable(
    small: SharedMemoryBackend,
) -> None:
    assert await small.put(["victim"], [_pattern(7, 64 * KIB)]) == [True]
    # The child overwrites "victim" and adds "new", copies every byte, then dies before
    # publishing (the before_publish test hook).
    child = _run_child(
        """
        async def main():
            backend = await SharedMemoryBackend.open(config())
            backend.before_publish = lambda keys: os.kill(os.getpid(), signal.SIGKILL)
            await backend.put(["victim", "new"], [bytes([9]) * (64 << 10), bytes(3 << 20)])
        asyncio.run(main())
        """,
        small.config.name,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert await small.exists(["victim", "new"]) == [True, False]
    assert await small.get(["victim"]) == [_pattern(7, 64 * KIB)]  # the old, whole value
    stats = await small.stats()
    assert stats["writing"] == 2
    assert stats["free_bytes"] == 4 * MIB - 64 * KIB - (64 * KIB + 3 * MIB)
    # A writer short of space reclaims the dead reservation before evicting anything.
    assert await small.put(["fits-now"], [bytes(2 * MIB)]) == [True]
    stats = await small.stats()
    assert (stats["writing"], stats["reclaimed_dead_writes"], stats["evictions"]) == (0, 2, 0)
    assert await small.exists(["victim", "fits-now"]) == [True, True]


async def test_reclaim_on_open_and_live_writers_are_kept(small: SharedMemoryBackend) -> None:
    index = small._index
    with index.locked():
        mine = index.reserve(b"in-flight", key_hash(b"in-flight"), 64 * KIB)  # alive: ours
    assert mine is not None
    child = _run_child(
        """
        async def main():
            backend = await SharedMemoryBackend.open(config())
            backend.before_publish = lambda keys: os.kill(os.getpid(), signal.SIGKILL)
            await backend.put(["doomed"], [bytes(100)])
        asyncio.run(main())
        """,
        small.config.name,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert (await small.stats())["writing"] == 2
    assert await small.reclaim_dead_writes() == 1  # the child's, not ours
    with index.locked():
        assert index.publish(mine)
    assert await small.exists(["in-flight", "doomed"]) == [True, False]


async def test_dead_writer_found_by_pid_without_ofd_locks(
    small: SharedMemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where OFD locks do not exist (not Linux), liveness falls back to the recorded pid.
    monkeypatch.setattr(shm_layout, "_OFD", False)
    child = _run_child(
        """
        async def main():
            backend = await SharedMemoryBackend.open(config())
            backend.before_publish = lambda keys: os.kill(os.getpid(), signal.SIGKILL)
            await backend.put(["doomed"], [bytes(100)])
        asyncio.run(main())
        """,
        small.config.name,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert await small.reclaim_dead_writes() == 1
    assert (await small.stats())["free_bytes"] == 4 * MIB


async def test_writer_dying_inside_the_lock_is_repaired(small: SharedMemoryBackend) -> None:
    assert await small.put(["a", "b"], [b"x" * 100, b"y" * 200]) == [True, True]
    with small._index.locked():
        pending = small._index.reserve(b"pending", key_hash(b"pending"), 100 * KIB)
    assert pending is not None
    # As if a process had died between two writes of an index update.
    small._segment.header[Hdr.DIRTY] = 1
    stats = await small.stats()  # the next locker repairs first
    assert (stats["objects"], stats["used_bytes"], stats["writing"]) == (0, 0, 1)
    assert stats["free_bytes"] == 4 * MIB - 128 * KIB  # only the live reservation holds blocks
    assert await small.exists(["a", "b"]) == [False, False]
    with small._index.locked():
        assert small._index.publish(pending)  # a live writer's reservation survived
    assert await small.put(["c"], [b"z" * 10]) == [True]
    assert await small.exists(["a", "b", "c", "pending"]) == [False, False, True, True]


# ----- torn reads -------------------------------------------------------------------------------
@pytest.mark.parametrize("interfered_rounds", [1, 2])
async def test_reads_overlapping_a_reuse_of_their_blocks_are_redone(
    small: SharedMemoryBackend, monkeypatch: pytest.MonkeyPatch, interfered_rounds: int
) -> None:
    size = 1 * MIB
    assert await small.put(["shared"], [_pattern(1, size)]) == [True]
    writer = await SharedMemoryBackend.open(_config(small.config.name, capacity_bytes=None))
    real_run = shm_module.run_copies
    state = {"rounds": 0, "next": 2, "inside": False}

    def run_with_interference(plan: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if not state["inside"]:
            state["rounds"] += 1
            if state["rounds"] <= interfered_rounds:
                # Between the reader's lookup and its copy, another writer overwrites the key
                # twice: the second version lands in the blocks the reader is about to copy.
                state["inside"] = True
                for _ in range(2):
                    writer._put_sync(["shared"], [[memoryview(_pattern(state["next"], size))]])
                    state["next"] += 1
                state["inside"] = False
        real_run(plan)

    monkeypatch.setattr(shm_module, "run_copies", run_with_interference)
    try:
        buf = bytearray(size)
        assert await small.get_into(["shared"], [buf]) == [size]
        # Never a mix: the version current at the last round (with two interfered rounds,
        # the third copies under the lock).
        assert bytes(buf) == _pattern(1 + 2 * interfered_rounds, size)
        assert (await small.stats())["torn_read_retries"] == interfered_rounds
    finally:
        await writer.close()


async def test_concurrent_processes_never_see_torn_objects(name: str) -> None:
    size, rounds = 512 * KIB, 150
    backend = await SharedMemoryBackend.open(_config(name, capacity_bytes=2 * MIB))
    try:
        assert await backend.put(["hot"], [_pattern(0, size)]) == [True]
        writer = asyncio.create_task(
            asyncio.to_thread(
                _run_child,
                f"""
                async def main():
                    backend = await SharedMemoryBackend.open(config())
                    for i in range(1, {rounds} + 1):
                        assert await backend.put(["hot"], [bytes([i % 251]) * {size}]) == [True]
                    await backend.close()
                asyncio.run(main())
                """,
                name,
            )
        )
        buf = np.empty(size, np.uint8)
        hits = 0
        while not writer.done():
            (n,) = await backend.get_into(["hot"], [buf])
            if n != MISS:
                assert n == size
                assert (buf == buf[0]).all(), "a torn object was returned"
                hits += 1
        child = await writer
        assert child.returncode == 0, child.stderr
        assert hits > 0
        assert await backend.get(["hot"]) == [_pattern(rounds, size)]
    finally:
        await backend.close()


# ----- eviction and limits ----------------------------------------------------------------------
async def test_lru_eviction_order(name: str) -> None:
    backend = await SharedMemoryBackend.open(
        _config(name, capacity_bytes=16 * KIB, block_bytes=4 * KIB)
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
    backend = await SharedMemoryBackend.open(_config(name, max_objects=2))
    try:
        assert await backend.put(["x", "y", "z"], [b"1", b"2", b"3"]) == [True] * 3
        assert await backend.exists(["x", "y", "z"]) == [False, True, True]
        assert await backend.put(["empty"], [b""]) == [True]  # no blocks, still an entry
        assert (await backend.stats())["objects"] == 2
    finally:
        await backend.close()


async def test_batch_larger_than_capacity_keeps_the_last(small: SharedMemoryBackend) -> None:
    values = [_pattern(i, 1 * MIB) for i in range(6)]
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
    backend = await SharedMemoryBackend.open(_config(name, capacity_bytes=96 * MIB))
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
    backend = await SharedMemoryBackend.open(_config(name))
    assert await backend.put(["k"], [b"v"]) == [True]
    assert path.exists()
    assert backend.unlink() is True
    assert not path.exists()
    assert await backend.get(["k"]) == [b"v"]  # attached processes keep their copy
    fresh = await SharedMemoryBackend.open(_config(name))
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
    backend = await SharedMemoryBackend.open(_config(name))
    assert await backend.put(["k"], [b"kept"]) == [True]
    await backend.close()
    assert path.exists()
    backend = await SharedMemoryBackend.open(_config(name, unlink_on_close=True))
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
            await SharedMemoryBackend.open(_config(small.config.name, **mismatch))


@pytest.mark.parametrize("content", [b"not a segment" * 100, b"abc"])
async def test_a_foreign_file_is_refused_and_kept(name: str, content: bytes) -> None:
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    path.write_bytes(content)
    with pytest.raises(BackendUnavailableError, match="not a hicache shared memory segment"):
        await SharedMemoryBackend.open(_config(name))
    assert path.read_bytes() == content


async def test_a_segment_of_another_version_is_refused(name: str) -> None:
    backend = await SharedMemoryBackend.open(_config(name))
    await backend.close()
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    with path.open("r+b") as f:
        f.seek(8 * Hdr.VERSION)
        f.write((99).to_bytes(8, sys.byteorder))
    with pytest.raises(BackendUnavailableError, match="incompatible hicache version"):
        await SharedMemoryBackend.open(_config(name))


async def test_a_creator_that_died_before_the_magic_is_redone(name: str) -> None:
    path = pathlib.Path(SHM_DIR, f"hicache-{name}.shm")
    path.write_bytes(bytes(1 << 16))  # sized, but the magic (written last) never came
    backend = await SharedMemoryBackend.open(_config(name))
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
