"""The file backend: the conformance suite, then what only a filesystem can get wrong."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import pathlib
import threading
import time
from typing import Any

import pytest
from file_kit import (
    files_under,
    object_path,
    open_file,
    opened_store,
    put_in_order,
    read,
    resolve_by,
    snapshot,
    write_temp,
)
from file_kit import tiny_tmpfs as mount_tiny_tmpfs

from hicache.backends.base import StorageBackend
from hicache.backends.file import FileBackend, FileConfig
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidKeyError,
    ReadOnlyStoreError,
)


class TestFileConformance(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await FileBackend.open(FileConfig(root=str(location)))

    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        path = object_path(pathlib.Path(backend.config.root), key)  # type: ignore[attr-defined]
        return path.read_bytes() if path.exists() else None

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        # As another process's writer would: a whole file, published by a rename.
        path = object_path(pathlib.Path(backend.config.root), key)  # type: ignore[attr-defined]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{key}.raw.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


class TestFileConformanceWalking(TestFileConformance):
    """The suite again as on a kernel without ``openat2``: paths walked a component at a time."""

    @pytest.fixture(autouse=True)
    def _walk(self, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
        resolve_by("walk", monkeypatch, tmp_path)


store = pytest.fixture(opened_store, name="store")


# ----- configuration and opening ------------------------------------------------------------
def test_config_from_url() -> None:
    url = "file:///var/cache/hi%20cache?fsync=true&max_bytes=10G&o_direct=1&io_threads=8"
    config = FileBackend.config_from_url(url, {})
    assert config == FileConfig("/var/cache/hi cache", True, True, 10 << 30, 8)
    assert FileConfig(root="rel/dir").root == os.path.join(os.getcwd(), "rel", "dir")
    for bad in ("file://otherhost/x", "file://", "file:///x?max_bytes=0", "file:///x?io_threads=0"):
        with pytest.raises(ConfigError):
            FileBackend.config_from_url(bad, {})
    with pytest.raises(ConfigError, match="names a local path"):  # a host other than localhost
        FileBackend.config_from_url("file://nas.example/srv/cache", {})
    assert FileBackend.config_from_url("file://localhost/srv/c", {}).root == "/srv/c"


async def test_open_refuses_unusable_roots(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(BackendUnavailableError, match="not a directory"):
        await open_file(tmp_path / "plain")
    real_open = os.open

    def refuse_probe(path: str, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if "/.probe." in path:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", refuse_probe)
    with pytest.raises(BackendUnavailableError, match=r"Permission denied.*permissions"):
        await open_file(tmp_path / "readonly")
    assert (tmp_path / "readonly").is_dir()  # created, then found unwritable


def test_url_query_may_not_repeat_the_location() -> None:
    """``?root=`` used to win over the URL's path, silently."""
    with pytest.raises(ConfigError, match=r"root twice: '/srv/a' .* '/srv/b'"):
        FileBackend.config_from_url("file:///srv/a?root=/srv/b", {})
    assert FileBackend.config_from_url("file:///srv/a?read_only=true", {}).read_only


async def test_read_only_open_changes_nothing(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "store"
    backend = await open_file(root)
    await put_in_order(backend, ["a", "b", "c"], b"x" * 100)
    await backend.close()
    before = snapshot(root)
    reader = await open_file(root, read_only=True, max_bytes=150)  # the cap would evict two
    assert await reader.get(["a", "b", "c"]) == [b"x" * 100] * 3
    with pytest.raises(ReadOnlyStoreError, match="opened read-only"):
        await reader.put(["d"], [b"y"])
    with pytest.raises(ReadOnlyStoreError):
        await reader.delete(["a"])
    with pytest.raises(ReadOnlyStoreError):
        await reader.remove_temp_files(0)
    stats = await reader.stats()
    assert (stats["objects"], stats["evictions"]) == (3, 0)
    await reader.close()
    assert snapshot(root) == before
    with pytest.raises(BackendUnavailableError, match="no store"):
        await open_file(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()


# ----- layout and atomic publication ----------------------------------------------------------
async def test_layout_and_no_temp_left(store: FileBackend, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "store"
    keys = ["page-a", "page-b"]
    assert await store.put(keys, [b"alpha", [b"be", b"", b"ta"]]) == [True, True]
    assert files_under(root) == sorted(str(object_path(root, k).relative_to(root)) for k in keys)
    assert object_path(root, "page-b").read_bytes() == b"beta"


async def test_crash_before_rename_leaves_only_an_ignored_dot_file(
    store: FileBackend, tmp_path: pathlib.Path
) -> None:
    root = tmp_path / "store"
    # The state a crash between the write and the rename leaves: a complete temp file only.
    tmp = write_temp(store, "k", b"orphan")
    assert tmp.name.startswith(".k.") and tmp.parent == object_path(root, "k").parent
    assert await store.exists(["k"]) == [False]
    assert await read(store, "k", 16) is None
    assert [info async for info in store.scan()] == []
    reopened = await open_file(root)
    assert (await reopened.stats())["objects"] == 0
    await reopened.close()
    assert tmp.exists()  # left for `hicache compact`, invisible until then


# ----- storage failures -----------------------------------------------------------------------
async def test_enospc_mid_write_is_false_and_leaves_nothing(
    store: FileBackend,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "store"
    assert await store.put(["k"], [b"old" * 1000]) == [True]
    real_writev = os.writev
    calls = 0

    def fill_then_fail(fd: int, buffers: list[memoryview]) -> int:
        nonlocal calls
        calls += 1
        if calls % 2:  # half of the object lands, then the disk is full
            return real_writev(fd, [buffers[0][: buffers[0].nbytes // 2]])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", fill_then_fail)
    with caplog.at_level(logging.DEBUG, logger="hicache.backends.file"):
        assert await store.put(["k"], [b"new" * 1000]) == [False]
        assert await store.put(["fresh"], [b"x" * 5000]) == [False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space" in warnings[0].getMessage()
    stats = await store.stats()
    assert stats["enospc"] == 2 and stats["put_errors"] == 2 and stats["put_failures"] == 2
    assert await read(store, "k", 3000) == b"old" * 1000  # the previous object is intact
    assert await store.exists(["fresh"]) == [False]
    assert files_under(root) == [str(object_path(root, "k").relative_to(root))]


tiny_tmpfs = pytest.fixture(mount_tiny_tmpfs, name="tiny_tmpfs")


async def test_real_enospc_on_a_full_filesystem(tiny_tmpfs: pathlib.Path) -> None:
    backend = await open_file(tiny_tmpfs)
    try:
        assert await backend.put(["first"], [b"a" * (700 << 10)]) == [True]
        assert await backend.put(["second"], [b"b" * (700 << 10)]) == [False]
        assert (await backend.stats())["enospc"] == 1
        assert await backend.exists(["first", "second"]) == [True, False]
        assert await read(backend, "first", 700 << 10) == b"a" * (700 << 10)
        assert files_under(tiny_tmpfs) == [
            str(object_path(tiny_tmpfs, "first").relative_to(tiny_tmpfs))
        ]
    finally:
        await backend.close()


# ----- size cap and eviction ------------------------------------------------------------------
async def test_cap_evicts_least_recently_used(tmp_path: pathlib.Path) -> None:
    backend = await open_file(tmp_path, max_bytes=300)
    await put_in_order(backend, ["a", "b", "c"], b"x" * 100)
    assert await read(backend, "a", 100) == b"x" * 100  # a is now the most recent
    assert await backend.put(["d"], [b"y" * 100]) == [True]
    assert await backend.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert not object_path(tmp_path, "b").exists()
    assert await backend.put(["huge"], [b"z" * 301]) == [False]
    stats = await backend.stats()
    assert stats["evictions"] == 1 and stats["used_bytes"] == 300 and stats["put_too_large"] == 1
    assert backend.capabilities.max_object_bytes == 300
    await backend.close()


async def test_object_being_read_is_not_evicted(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = await open_file(tmp_path, max_bytes=300)
    await put_in_order(backend, ["a", "b", "c"], b"x" * 100)
    reading, release = threading.Event(), threading.Event()
    real_preadv = os.preadv

    def slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        reading.set()
        release.wait(10)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    buf = bytearray(100)
    pending = asyncio.ensure_future(backend.get_into(["a"], [buf]))
    try:
        assert await asyncio.to_thread(reading.wait, 10)
        # a is least recently used, but in flight: b goes instead.
        assert await backend.put(["d"], [b"y" * 100]) == [True]
        # Making room for 300 bytes would need a: refused, nothing else evicted for it.
        assert await backend.put(["big"], [b"z" * 300]) == [False]
    finally:
        release.set()
    assert await pending == [100] and bytes(buf) == b"x" * 100
    assert await backend.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    stats = await backend.stats()
    assert stats["put_no_room"] == 1 and stats["evictions"] == 1
    await backend.close()


async def test_restart_rebuilds_index_and_cap(tmp_path: pathlib.Path) -> None:
    backend = await open_file(tmp_path)
    assert await backend.put(["a", "b", "c"], [b"1" * 100, b"2" * 100, b"3" * 100]) == [True] * 3
    await backend.close()
    for key, mtime in (("c", 1000), ("a", 2000), ("b", 3000)):  # c is the oldest write
        os.utime(object_path(tmp_path, key), (mtime, mtime))
    warm = await open_file(tmp_path, max_bytes=1000)
    stats = await warm.stats()
    assert stats["objects"] == 3 and stats["used_bytes"] == 300
    assert await read(warm, "b", 100) == b"2" * 100
    await warm.close()
    smaller = await open_file(tmp_path, max_bytes=250)  # a lowered cap holds at once
    assert await smaller.exists(["a", "b", "c"]) == [True, True, False]
    stats = await smaller.stats()
    assert stats["evictions"] == 1 and stats["used_bytes"] == 200
    await smaller.close()


# ----- scanning and keys ----------------------------------------------------------------------
async def test_scan_lists_objects_only(store: FileBackend, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "store"
    before = time.time()
    assert await store.put(["p1", "p2", "q1"], [b"abc", b"abcde", b"z"]) == [True] * 3
    (root / ".hidden").write_bytes(b"x")
    (root / "zz").mkdir()
    (root / "zz" / "p9").write_bytes(b"x")
    object_path(root, "p1").with_name(".p1.1.ab.tmp").write_bytes(b"x")
    misplaced = object_path(root, "p1").with_name("p3")  # a valid name in the wrong directory
    if misplaced.parent != object_path(root, "p3").parent:
        misplaced.write_bytes(b"x")
    found = {info.key: info async for info in store.scan("p")}
    assert {k: info.size for k, info in found.items()} == {"p1": 3, "p2": 5}
    assert all(before - 2 <= info.mtime <= time.time() + 2 for info in found.values())
    assert sorted([info.key async for info in store.scan()]) == ["p1", "p2", "q1"]


async def test_nothing_escapes_root(store: FileBackend, tmp_path: pathlib.Path) -> None:
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for key in ("../x", "a/b", ".hidden", "..", "/etc/x"):
        with pytest.raises(InvalidKeyError):
            await store.put([key], [b"1"])
        with pytest.raises(InvalidKeyError):
            await store.get_into([key], [bytearray(1)])
        with pytest.raises(InvalidKeyError):
            await store.delete([key])
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / "x").exists()
