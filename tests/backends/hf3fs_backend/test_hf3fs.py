"""The ``3fs`` backend: the conformance suite in POSIX mode and in USRBIO mode (against the
file-backed stand-in for ``hf3fs_py_usrbio``), then what only a slot store can get wrong."""

from __future__ import annotations

import errno
import glob
import os
import pathlib
import sys
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import hf3fs_kit
import pytest

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.hf3fs import Hf3fsBackend, Hf3fsConfig, Hf3fsMode
from hicache.backends.hf3fs import slots as hf3fs_slots
from hicache.backends.hf3fs.index import RECORD
from hicache.backends.registry import open_backend
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import BackendUnavailableError, ConfigError

SLOT = (1 << 20) + 8192  # holds the suite's largest round-trip size, (1 << 20) + 3
SLOTS = 512  # the suite keeps at most a few hundred objects at once


async def open_posix(root: pathlib.Path, **options: Any) -> Hf3fsBackend:
    options = {"slot_bytes": SLOT, "slots": SLOTS, "mode": Hf3fsMode.POSIX, **options}
    return await Hf3fsBackend.open(Hf3fsConfig(root=str(root), **options))


def make_mount(root: pathlib.Path) -> pathlib.Path:
    """Make ``root`` look like a 3FS mount to the stand-in (it has ``3fs-virt/iovs``)."""
    (root / "3fs-virt" / "iovs").mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture
def fake_usrbio(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setitem(sys.modules, "hf3fs_py_usrbio", hf3fs_kit)
    return hf3fs_kit


class TestHf3fsPosixConformance(BackendConformanceTests):
    # No size override: capabilities.max_object_bytes (one slot) caps the suite's objects.
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await open_posix(location)


class TestHf3fsUsrbioConformance(BackendConformanceTests):
    @pytest.fixture(autouse=True)
    def _usrbio(self, fake_usrbio: ModuleType) -> None:
        """Every test of this class runs with the stand-in client importable."""

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        backend = await open_posix(make_mount(location), mode=Hf3fsMode.USRBIO)
        assert backend.mode is Hf3fsMode.USRBIO
        return backend

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        # Closed backends leave nothing registered and no staging buffer announced.
        assert hf3fs_kit.registered_fds() == set()
        assert list((location / "3fs-virt" / "iovs").iterdir()) == []


@pytest.fixture
async def store(tmp_path: pathlib.Path) -> AsyncIterator[Hf3fsBackend]:
    backend = await open_posix(tmp_path)
    yield backend
    await backend.close()


def index_path(root: pathlib.Path, rank: int = 0) -> pathlib.Path:
    return root / f"hicache-rank{rank}.index"


# ----- configuration and opening ------------------------------------------------------------
def test_config_from_url() -> None:
    url = "3fs:///mnt/3fs/kv%20cache?rank=2&slots=10&slot_bytes=1M&mode=posix&io_threads=2"
    config = Hf3fsBackend.config_from_url(url, {"fsync": True})
    assert config == Hf3fsConfig("/mnt/3fs/kv cache", 2, 1 << 20, 10, 2, Hf3fsMode.POSIX, True)
    assert Hf3fsBackend.config_from_url("hf3fs:///x?mode=usrbio", {}).mode is Hf3fsMode.USRBIO
    assert Hf3fsConfig("/x").mode is Hf3fsMode.AUTO
    bad = ["3fs://host/x", "3fs://", "3fs:///x?slots=0", "3fs:///x?rank=-1", "3fs:///x?mode=nfs"]
    for url in [*bad, "3fs:///x?slot_bytes=0", "3fs:///x?io_threads=0"]:
        with pytest.raises(ConfigError):
            Hf3fsBackend.config_from_url(url, {})


async def test_registry_opens_both_schemes(tmp_path: pathlib.Path) -> None:
    for scheme in ("3fs", "hf3fs"):
        backend = await open_backend(f"{scheme}://{tmp_path}?mode=posix&slots=4&slot_bytes=64K")
        try:
            assert isinstance(backend, Hf3fsBackend)
            assert backend.capabilities.max_object_bytes == 64 << 10
            assert await backend.put(["k"], [scheme.encode()]) == [True]
            assert await backend.get(["k"]) == [scheme.encode()]
        finally:
            await backend.close()


async def test_unusable_roots_raise_typed_errors(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(BackendUnavailableError, match="does not exist: mount 3FS"):
        await open_posix(tmp_path / "not-mounted")
    assert not (tmp_path / "not-mounted").exists()  # never created in place of a mount
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(BackendUnavailableError, match="not a directory"):
        await open_posix(tmp_path / "file")
    monkeypatch.setattr(os, "access", lambda *_: False)  # root ignores permission bits
    with pytest.raises(BackendUnavailableError, match="not writable"):
        await open_posix(tmp_path)


async def test_second_writer_on_a_rank_is_refused(tmp_path: pathlib.Path) -> None:
    first = await open_posix(tmp_path)
    try:
        with pytest.raises(BackendUnavailableError, match="its own rank"):
            await open_posix(tmp_path)
        other = await open_posix(tmp_path, rank=1)  # another rank is another file
        await other.close()
        assert await first.put(["k"], [b"v"]) == [True]
    finally:
        await first.close()
    again = await open_posix(tmp_path)  # the lock went with the first writer
    assert await again.get(["k"]) == [b"v"]
    await again.close()


async def test_geometry_change_is_refused(tmp_path: pathlib.Path) -> None:
    await (await open_posix(tmp_path)).close()
    with pytest.raises(ConfigError, match=f"slot_bytes={SLOT}, slots={SLOTS}"):
        await open_posix(tmp_path, slots=SLOTS * 2)


async def test_oversize_put_is_refused_and_counted(store: Hf3fsBackend) -> None:
    assert store.capabilities.max_object_bytes == SLOT
    too_big = bytes(SLOT + 1)
    assert await store.put(["big", "ok"], [too_big, bytes(SLOT)]) == [False, True]
    assert await store.exists(["big", "ok"]) == [False, True]
    stats = await store.stats()
    assert (stats["put_too_large"], stats["put_failures"], stats["puts"]) == (1, 1, 1)


# ----- modes ----------------------------------------------------------------------------------
async def test_auto_mode_picks_usrbio_on_a_mount(
    tmp_path: pathlib.Path, fake_usrbio: ModuleType
) -> None:
    before = fake_usrbio.ios_done
    backend = await open_posix(make_mount(tmp_path), mode=Hf3fsMode.AUTO)
    try:
        assert backend.mode is Hf3fsMode.USRBIO
        assert await backend.put(["k"], [b"via usrbio"]) == [True]
        assert await backend.get(["k"]) == [b"via usrbio"]
        stats = await backend.stats()
        assert fake_usrbio.ios_done > before and stats["usrbio"] == 1
        assert stats["bytes_staged"] == 2 * len(b"via usrbio")  # through a lane both ways
    finally:
        await backend.close()
    assert glob.glob("/dev/shm/hicache-3fs-*") == []  # staging segments are never left behind


async def test_auto_mode_falls_back_to_posix(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "hf3fs_py_usrbio", None)  # not importable
    backend = await open_posix(make_mount(tmp_path), mode=Hf3fsMode.AUTO)
    assert backend.mode is Hf3fsMode.POSIX
    assert await backend.put(["k"], [[b"head", b"page"]]) == [True]
    assert await backend.get(["k"]) == [b"headpage"]
    assert (await backend.stats())["bytes_staged"] == 0  # pwritev/preadv on the caller's views
    await backend.close()
    with pytest.raises(BackendUnavailableError, match="hf3fs_py_usrbio"):
        await open_posix(tmp_path, mode=Hf3fsMode.USRBIO)


async def test_usrbio_needs_a_3fs_mount(tmp_path: pathlib.Path, fake_usrbio: ModuleType) -> None:
    with pytest.raises(BackendUnavailableError, match="not on a 3FS mount"):
        await open_posix(tmp_path, mode=Hf3fsMode.USRBIO)
    backend = await open_posix(tmp_path, mode=Hf3fsMode.AUTO)  # no mount: POSIX
    assert backend.mode is Hf3fsMode.POSIX
    await backend.close()
    assert fake_usrbio.registered_fds() == set()


async def test_usrbio_and_posix_read_each_others_store(
    tmp_path: pathlib.Path, fake_usrbio: ModuleType
) -> None:
    values = {f"x{i}": os.urandom(1000 * i + 1) for i in range(10)}
    writer = await open_posix(make_mount(tmp_path), mode=Hf3fsMode.USRBIO)
    assert await writer.put(list(values), list(values.values())) == [True] * 10
    await writer.close()
    reader = await open_posix(tmp_path, mode=Hf3fsMode.POSIX)
    assert await reader.get(list(values)) == list(values.values())
    await reader.close()


async def test_usrbio_io_errors_fail_puts_and_reads_cleanly(
    tmp_path: pathlib.Path, fake_usrbio: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = await open_posix(make_mount(tmp_path), mode=Hf3fsMode.USRBIO)
    try:
        assert await backend.put(["kept"], [b"kept"]) == [True]
        monkeypatch.setattr(fake_usrbio, "fail_with", errno.EIO)
        assert await backend.put(["lost", "kept"], [b"x", b"new"]) == [False, False]
        assert await backend.get_into(["kept"], [bytearray(4)]) == [MISS]
        monkeypatch.setattr(fake_usrbio, "fail_with", 0)
        assert await backend.exists(["lost", "kept"]) == [False, True]
        assert await backend.get(["kept"]) == [b"kept"]  # the failed rewrite changed nothing
        stats = await backend.stats()
        assert (stats["put_errors"], stats["read_errors"]) == (2, 1)
        assert stats["free_slots"] == SLOTS - 1  # the failed writes' slots came back
    finally:
        await backend.close()


# ----- the index: replay, damage, compaction ------------------------------------------------
async def test_reopen_replays_the_index(tmp_path: pathlib.Path) -> None:
    backend = await open_posix(tmp_path)
    assert await backend.put(["a", "b", "c"], [b"1", b"2" * 5000, b"3"]) == [True] * 3
    assert await backend.put(["b"], [b"two"]) == [True]
    assert await backend.delete(["c"]) == [True]
    await backend.close()
    backend = await open_posix(tmp_path)
    try:
        assert await backend.get(["a", "b", "c"]) == [b"1", b"two", None]
        stats = await backend.stats()
        assert (stats["objects"], stats["free_slots"]) == (2, SLOTS - 2)
        assert stats["index_records"] == 2  # superseded records were compacted away at open
    finally:
        await backend.close()


async def test_torn_index_tail_loses_only_the_torn_record(tmp_path: pathlib.Path) -> None:
    backend = await open_posix(tmp_path)
    for key in ("a", "b", "c"):  # one record each, in this order
        assert await backend.put([key], [key.encode() * 100]) == [True]
    await backend.close()
    path = index_path(tmp_path)
    os.truncate(path, path.stat().st_size - RECORD // 2)  # a crash mid-append of "c"
    backend = await open_posix(tmp_path)
    try:
        assert await backend.get(["a", "b", "c"]) == [b"a" * 100, b"b" * 100, None]
        assert (await backend.stats())["index_torn_bytes"] == RECORD // 2
        assert await backend.put(["d"], [b"after"]) == [True]  # appends on a record boundary
    finally:
        await backend.close()
    backend = await open_posix(tmp_path)
    assert await backend.get(["a", "b", "d"]) == [b"a" * 100, b"b" * 100, b"after"]
    await backend.close()


async def test_corrupt_record_is_a_miss_never_other_data(tmp_path: pathlib.Path) -> None:
    backend = await open_posix(tmp_path)
    for key in ("a", "b", "c"):
        assert await backend.put([key], [key.encode() * 100]) == [True]
    assert await backend.put(["k"], [b"first"]) == [True]
    assert await backend.put(["k"], [b"second"]) == [True]  # its older slot is freed
    await backend.close()
    with open(index_path(tmp_path), "r+b") as f:  # record 0 is the file header
        for record in (2, 5):  # "b" and the second put of "k"
            f.seek(record * RECORD + 30)
            f.write(b"\xff\xfe")
    backend = await open_posix(tmp_path)
    try:
        # "k" falls back to its first record, whose slot was zeroed when it died: a miss.
        got = await backend.get(["a", "b", "c", "k"])
        assert got == [b"a" * 100, None, b"c" * 100, None]
        stats = await backend.stats()
        assert (stats["index_corrupt_records"], stats["slot_mismatches"]) == (2, 1)
    finally:
        await backend.close()


async def test_stale_record_for_a_reused_slot_is_a_miss(tmp_path: pathlib.Path) -> None:
    backend = await open_posix(tmp_path, slots=1)
    assert await backend.put(["old"], [b"old data"]) == [True]
    await backend.close()
    saved = index_path(tmp_path).read_bytes()  # says "old" is in slot 0
    backend = await open_posix(tmp_path, slots=1)
    assert await backend.delete(["old"]) == [True]
    assert await backend.put(["new"], [b"new data"]) == [True]  # slot 0 again
    await backend.close()
    index_path(tmp_path).write_bytes(saved)  # as if the index lost its last records
    backend = await open_posix(tmp_path, slots=1)
    try:
        assert await backend.get(["old", "new"]) == [None, None]
        assert (await backend.stats())["slot_mismatches"] == 1
    finally:
        await backend.close()


async def test_slot_reuse_never_serves_old_data(store: Hf3fsBackend) -> None:
    for round_ in range(3 * SLOTS // 100):  # enough churn to cycle every slot
        keys = [f"r{round_}-{i}" for i in range(100)]
        values = [f"{key}:".encode() * (i + 1) for i, key in enumerate(keys)]
        assert await store.put(keys, values) == [True] * 100
        assert await store.get(keys) == values
        if round_:
            previous = [f"r{round_ - 1}-{i}" for i in range(100)]
            assert await store.delete(previous[::2]) == [True] * 50
            assert await store.get(previous[::2]) == [None] * 50
            assert await store.put(previous[1::2], [b"over"] * 50) == [True] * 50
            assert await store.get(previous[1::2]) == [b"over"] * 50


async def test_full_store_evicts_least_recently_used(tmp_path: pathlib.Path) -> None:
    backend = await open_posix(tmp_path, slots=4)
    try:
        for i in range(4):
            assert await backend.put([f"k{i}"], [f"v{i}".encode()]) == [True]
        assert await backend.get(["k0"]) == [b"v0"]  # now k1 is the least recently used
        assert await backend.put(["k4"], [b"v4"]) == [True]
        assert await backend.exists([f"k{i}" for i in range(5)]) == [True, False, True, True, True]
        assert (await backend.stats())["evictions"] == 1
        assert await backend.get(["k0", "k2", "k3", "k4"]) == [b"v0", b"v2", b"v3", b"v4"]
    finally:
        await backend.close()
    backend = await open_posix(tmp_path, slots=4)  # the eviction was logged
    assert await backend.exists(["k1", "k4"]) == [False, True]
    await backend.close()


async def test_compaction_keeps_the_latest_values(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf3fs_slots, "_COMPACT_MIN", 8)
    backend = await open_posix(tmp_path, fsync=True)
    for i in range(40):
        assert await backend.put(["hot", f"c{i % 3}"], [f"{i}".encode(), b"c"]) == [True, True]
    stats = await backend.stats()
    assert stats["compactions"] >= 1 and stats["index_records"] <= 2 * 4 + 8
    await backend.close()
    backend = await open_posix(tmp_path)
    assert await backend.get(["hot", "c0", "c1", "c2"]) == [b"39", b"c", b"c", b"c"]
    assert (await backend.stats())["index_corrupt_records"] == 0
    await backend.close()


async def test_files_live_under_root(tmp_path: pathlib.Path) -> None:
    backend = await open_posix(tmp_path, rank=3, slots=8, slot_bytes=4096)
    assert await backend.put(["k"], [b"v"]) == [True]
    await backend.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["hicache-rank3.data", "hicache-rank3.index"]
    assert (tmp_path / "hicache-rank3.data").stat().st_size == 8 * 8192  # header + slot


async def test_buffer_too_small_reads_nothing(store: Hf3fsBackend) -> None:
    assert await store.put(["k"], [b"x" * 100]) == [True]
    buf = bytearray(b"\xee" * 10)
    assert await store.get_into(["k", "nope"], [buf, bytearray(1)]) == [100, MISS]
    assert buf == b"\xee" * 10


# ----- links: the store's files are never reached through a symbolic link ---------------------
def _files(directory: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.mark.parametrize("suffix", ["data", "index"])
async def test_a_store_file_that_is_a_link_is_refused(tmp_path: pathlib.Path, suffix: str) -> None:
    """Whoever can write in root could point the data file (sized, then written slot by slot)
    or the index (appended to) at any file: the open refuses, and the target is untouched."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    backend = await open_posix(root, slots=8, slot_bytes=4096)
    assert await backend.put(["k"], [b"v"]) == [True]
    await backend.close()
    own = root / f"hicache-rank0.{suffix}"
    victim = outside / "victim"
    victim.write_bytes(own.read_bytes())  # passes for the store's own file
    own.unlink()
    own.symlink_to(victim)
    before = _files(outside)
    with pytest.raises(BackendUnavailableError, match="symbolic link"):
        backend = await open_posix(root, slots=8, slot_bytes=4096)
        await backend.put(["k2"], [b"w" * 100])  # what a link-following store goes on to do
        await backend.close()
    assert _files(outside) == before


async def test_index_rewrite_never_writes_through_a_planted_link(tmp_path: pathlib.Path) -> None:
    """The rewrite's temporary file has a name anyone can predict (the pid): a link planted
    there must not lead the rewrite (which truncates) to another file."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    backend = await open_posix(root)
    assert await backend.put(["a", "b"], [b"1", b"2"]) == [True, True]
    assert await backend.put(["b"], [b"two"]) == [True]  # a superseded record: rewritten at open
    await backend.close()
    (outside / "victim").write_bytes(b"precious")
    (root / f"hicache-rank0.index.{os.getpid()}.tmp").symlink_to(outside / "victim")
    before = _files(outside)
    backend = await open_posix(root)
    try:
        assert await backend.get(["a", "b"]) == [b"1", b"two"]
        assert (await backend.stats())["index_records"] == 2
    finally:
        await backend.close()
    assert _files(outside) == before
    assert not index_path(root).is_symlink()


def test_url_query_may_not_repeat_the_location() -> None:
    with pytest.raises(ConfigError, match=r"root twice: '/mnt/a' .* '/mnt/b'"):
        Hf3fsBackend.config_from_url("3fs:///mnt/a?root=/mnt/b", {})
