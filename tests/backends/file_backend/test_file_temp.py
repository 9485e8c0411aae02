"""The file backend's temporary files (what crashed writers leave) and its ``peek`` fast path."""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import AsyncIterator

import pytest
from file_kit import write_temp

from hicache.backends.file import FileBackend, FileConfig
from hicache.backends.file.maintenance import TempFileOwner
from hicache.backends.memory import MemoryBackend


@pytest.fixture
async def store(tmp_path: pathlib.Path) -> AsyncIterator[FileBackend]:
    backend = await FileBackend.open(FileConfig(root=str(tmp_path / "store")))
    yield backend
    await backend.close()


def crashed_write(backend: FileBackend, key: str, age_s: float) -> pathlib.Path:
    """The temporary file a writer that died before its rename leaves, ``age_s`` old."""
    path = write_temp(backend, key, b"x" * 7)
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


async def test_only_backends_with_temp_files_own_them(store: FileBackend) -> None:
    assert isinstance(store, TempFileOwner)
    assert not isinstance(MemoryBackend(), TempFileOwner)


async def test_temp_files_are_listed_with_their_age(
    store: FileBackend, tmp_path: pathlib.Path
) -> None:
    root = tmp_path / "store"
    old = crashed_write(store, "page-a", age_s=3600)
    young = crashed_write(store, "page-b", age_s=1)
    probe = root / f".probe.{os.getpid()}.0123456789ab.tmp"  # open()'s probe, left by a crash
    probe.write_bytes(b"")
    (old.parent / ".not-ours").write_bytes(b"?")  # hidden, but not a writer's temp name
    assert await store.put(["page-c"], [b"published"]) == [True]
    found = {t.path: t async for t in store.scan_temp_files()}
    assert set(found) == {str(p.relative_to(root)) for p in (old, young, probe)}
    assert 3590 < found[str(old.relative_to(root))].age_s < 3700
    assert found[str(young.relative_to(root))].age_s < 60
    assert found[str(old.relative_to(root))].size == 7


async def test_remove_keeps_what_may_still_be_written(store: FileBackend) -> None:
    old = crashed_write(store, "page-a", age_s=3600)
    young = crashed_write(store, "page-b", age_s=60)
    assert await store.put(["page-c"], [b"published"]) == [True]
    removed = await store.remove_temp_files(min_age_s=600)
    assert [t.path.rsplit("/", 1)[-1] for t in removed] == [old.name]
    assert not old.exists() and young.exists()
    assert await store.get(["page-c"]) == [b"published"]
    assert [t.path for t in await store.remove_temp_files()] == []  # the default grace: 15 min


async def test_a_temp_file_touched_after_listing_is_kept(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = crashed_write(store, "page-a", age_s=3600)
    real_scan = store.scan_temp_files

    async def scan_then_touch() -> AsyncIterator[object]:
        async for info in real_scan():
            os.utime(tmp)  # a slow writer wrote again since the listing
            yield info

    monkeypatch.setattr(store, "scan_temp_files", scan_then_touch)
    assert await store.remove_temp_files(min_age_s=600) == []
    assert tmp.exists()


async def test_peek_does_not_touch_the_lru_order(tmp_path: pathlib.Path) -> None:
    store = await FileBackend.open(FileConfig(root=str(tmp_path / "s"), max_bytes=300))
    try:
        assert await store.put(["a"], [b"1" * 100]) == [True]
        assert await store.put(["b"], [b"2" * 100]) == [True]
        assert await store.put(["c"], [b"3" * 100]) == [True]
        assert await store.peek(["a"], 10) == [b"1" * 10]  # a read here would make "a" recent
        assert await store.put(["d"], [b"4" * 100]) == [True]
        assert await store.exists(["a", "b", "c", "d"]) == [False, True, True, True]
    finally:
        await store.close()
