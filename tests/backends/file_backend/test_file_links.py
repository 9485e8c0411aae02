"""The file backend never follows a symbolic link below its root (the link attack).

Each test builds the attack for real: a fan-out directory (``top``: root/ab, ``sub``:
root/ab/cd) or an object replaced by a symbolic link that leads outside the store, where a
victim file named like the key waits. Whoever can write inside the store can plant such a link;
no operation may then read, write or unlink anything outside the root, and the outside tree
must be byte-identical (mtimes included) afterwards.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import time
from collections.abc import AsyncIterator

import pytest
import xxhash
from file_kit import (
    LINK_PLACES,
    keys_in_distinct_tops,
    object_path,
    open_file,
    opened_store,
    plant_link,
    read,
    resolve_by,
    snapshot,
)

from hicache.backends.base import MISS
from hicache.backends.file import FileBackend
from hicache.backends.file.maintenance import TempFile

store = pytest.fixture(opened_store, name="store")


@pytest.fixture(autouse=True, params=["openat2", "walk"])
def resolver(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Every test runs with both ways of opening a key (see ``tree``)."""
    resolve_by(request.param, monkeypatch, tmp_path)


@pytest.fixture
def outside(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "outside"
    path.mkdir()
    return path


def _refused(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "symbolic link" in r.getMessage()
    ]


@pytest.mark.parametrize("where", LINK_PLACES)
async def test_reads_miss_through_a_link(
    store: FileBackend,
    tmp_path: pathlib.Path,
    outside: pathlib.Path,
    where: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    plant_link(tmp_path / "store", "k", outside, where)
    before = snapshot(outside)
    with caplog.at_level(logging.DEBUG, logger="hicache.backends.file"):
        assert await store.exists(["k"]) == [False]
        assert await store.get_into(["k"], [bytearray(64)]) == [MISS]
        assert await store.get(["k"]) == [None]
        assert await store.peek(["k"], 8) == [None]
    stats = await store.stats()
    assert stats["links_refused"] == 4 and stats["read_errors"] == 0
    assert len(_refused(caplog)) == 1  # warned once, counted each time
    assert snapshot(outside) == before


@pytest.mark.parametrize("where", ["top", "sub"])
async def test_put_never_writes_through_a_linked_directory(
    store: FileBackend, tmp_path: pathlib.Path, outside: pathlib.Path, where: str
) -> None:
    plant_link(tmp_path / "store", "k", outside, where)
    before = snapshot(outside)
    assert await store.put(["k"], [b"new bytes"]) == [False]
    assert snapshot(outside) == before  # no temporary file there either
    stats = await store.stats()
    assert stats["links_refused"] == 1 and stats["put_errors"] == 0 and stats["objects"] == 0


async def test_put_replaces_a_linked_object_not_its_target(
    store: FileBackend, tmp_path: pathlib.Path, outside: pathlib.Path
) -> None:
    """The rename replaces the link itself: the store heals, the target is left alone."""
    path = object_path(tmp_path / "store", "k")
    plant_link(tmp_path / "store", "k", outside, "object")
    before = snapshot(outside)
    assert await store.put(["k"], [b"new bytes"]) == [True]
    assert not path.is_symlink() and path.read_bytes() == b"new bytes"
    assert await read(store, "k", 64) == b"new bytes"
    assert snapshot(outside) == before


@pytest.mark.parametrize("where", LINK_PLACES)
async def test_delete_never_unlinks_through_a_link(
    store: FileBackend, tmp_path: pathlib.Path, outside: pathlib.Path, where: str
) -> None:
    plant_link(tmp_path / "store", "k", outside, where)
    before = snapshot(outside)
    assert await store.delete(["k"]) == [False]
    assert snapshot(outside) == before
    assert object_path(tmp_path / "store", "k").is_symlink() == (where == "object")
    assert (await store.stats())["links_refused"] == 1


@pytest.mark.parametrize("where", LINK_PLACES)
async def test_eviction_never_unlinks_through_a_link(
    tmp_path: pathlib.Path, outside: pathlib.Path, where: str
) -> None:
    root = tmp_path / "store"
    backend = await open_file(root, max_bytes=300)
    first, *others = keys_in_distinct_tops(4)
    assert await backend.put([first], [b"x" * 100]) == [True]
    plant_link(root, first, outside, where)  # after its put: the index still holds it
    before = snapshot(outside)
    for key in others:  # the third one makes room by evicting the first
        assert await backend.put([key], [b"y" * 100]) == [True]
    assert snapshot(outside) == before
    assert object_path(root, first).is_symlink() == (where == "object")
    stats = await backend.stats()
    assert stats["evictions"] == 1 and stats["links_refused"] == 1
    await backend.close()


async def test_listings_skip_links(
    store: FileBackend, tmp_path: pathlib.Path, outside: pathlib.Path
) -> None:
    """Scan, the bulk reader, the temp-file listing and the index at open see only the store."""
    root = tmp_path / "store"
    real = keys_in_distinct_tops(5, "real")
    assert await store.put(real[:2], [b"r1", b"r2"]) == [True, True]
    for key, where in zip(real[2:], LINK_PLACES, strict=True):
        victim = plant_link(root, key, outside, where)
        (victim.parent / f".{key}.1.{'0' * 12}.tmp").write_bytes(b"looks like a temp file")
    before = snapshot(outside)
    assert sorted([i.key async for i in store.scan()]) == sorted(real[:2])
    found = [pair async for b in store.read_all("", lambda k, v: k) for pair in b]
    assert sorted(found) == sorted(real[:2])
    assert [t async for t in store.scan_temp_files()] == []
    assert await store.remove_temp_files(min_age_s=0) == []
    reopened = await open_file(root)
    assert (await reopened.stats())["objects"] == 2
    await reopened.close()
    assert snapshot(outside) == before


async def test_temp_removal_does_not_follow_a_link_swapped_in_after_the_listing(
    store: FileBackend,
    tmp_path: pathlib.Path,
    outside: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "store"
    h = xxhash.xxh3_64_hexdigest(b"k")
    leaf = root / h[:2] / h[2:4]
    leaf.mkdir(parents=True)
    name = f".k.{os.getpid()}.{'a' * 12}.tmp"
    for directory in (leaf, outside):
        (directory / name).write_bytes(b"stale")
        os.utime(directory / name, (time.time() - 3600, time.time() - 3600))
    listed = [t async for t in store.scan_temp_files()]
    assert [t.path for t in listed] == [f"{h[:2]}/{h[2:4]}/{name}"]
    shutil.rmtree(leaf)  # between the listing and the removal, the directory becomes a link
    leaf.symlink_to(outside)
    before = snapshot(outside)

    async def the_old_listing() -> AsyncIterator[TempFile]:
        for info in listed:
            yield info

    monkeypatch.setattr(store, "scan_temp_files", the_old_listing)
    assert await store.remove_temp_files(min_age_s=60) == []
    assert snapshot(outside) == before


async def test_a_root_reached_through_a_link_still_works(
    tmp_path: pathlib.Path, outside: pathlib.Path
) -> None:
    """The root is the operator's choice: a link to it is resolved once, at open."""
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    backend = await open_file(tmp_path / "via")
    assert await backend.put(["k"], [b"data"]) == [True]
    assert object_path(tmp_path / "real", "k").read_bytes() == b"data"
    assert await read(backend, "k", 16) == b"data"
    assert [i.key async for i in backend.scan()] == ["k"]
    assert await backend.delete(["k"]) == [True]
    await backend.close()
