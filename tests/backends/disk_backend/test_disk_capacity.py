"""The disk backend's capacity: whole segments reclaimed least recently used first, objects
read since written reinserted, the disk kept within capacity plus a segment, and compaction
of mostly dead segments.
"""

from __future__ import annotations

import pathlib

import pytest
from disk_kit import KIB, disk_bytes, open_disk, segment_files

from hicache.backends.disk import DiskBackend

SEG = 64 * KIB
CAP = 4 * SEG
OBJ = 10 * KIB  # six records to a segment


def value(key: str) -> bytes:
    return (key.encode() * OBJ)[:OBJ]


def keys_of(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


async def put_each(backend: DiskBackend, root: pathlib.Path, keys: list[str]) -> None:
    """One put a key; with a capacity, the segments on disk never exceed it plus a segment."""
    for key in keys:
        assert await backend.put([key], [value(key)]) == [True]
        assert backend.config.capacity is None or disk_bytes(root) <= CAP + SEG


async def found(backend: DiskBackend, keys: list[str]) -> list[str]:
    """The keys present, each checked byte for byte."""
    got = await backend.get(keys, size_hint=OBJ)
    for key, data in zip(keys, got, strict=True):
        assert data is None or data == value(key), key
    return [k for k, data in zip(keys, got, strict=True) if data is not None]


def segment_of(backend: DiskBackend, key: str) -> int:
    entry = backend.catalog.index.get(key)
    assert entry is not None, key
    return entry[0]


@pytest.mark.asyncio
async def test_oldest_segments_are_reclaimed_first(tmp_path: pathlib.Path) -> None:
    """Ten segments' worth of puts into four segments' capacity: whole segments go, oldest
    first, so the survivors are the newest keys; a reopen finds the same ones, exact."""
    backend = await open_disk(tmp_path, capacity=CAP, segment_bytes=SEG, reinsert=False)
    largest = backend.capabilities.max_object_bytes
    assert largest is not None and OBJ < largest <= CAP // 2
    keys = keys_of(60)
    await put_each(backend, tmp_path, keys)
    stats = await backend.stats()
    assert stats["reclaimed_segments"] >= 5 and stats["reinserted"] == 0
    assert stats["disk_bytes"] <= CAP + SEG
    alive = await found(backend, keys)
    first = keys.index(alive[0])
    assert alive == keys[first:]  # a suffix: nothing newer went before something older
    assert len(alive) >= 3 * 6  # at least the three newest segments' objects
    assert await backend.put(["huge"], [bytes(largest + 1)]) == [False]
    assert (await backend.stats())["put_too_large"] == 1
    await backend.close()
    reader = await open_disk(tmp_path, read_only=True)
    assert await found(reader, keys) == alive
    await reader.close()


@pytest.mark.parametrize("reinsert", [True, False])
@pytest.mark.asyncio
async def test_objects_read_since_written_are_reinserted(
    tmp_path: pathlib.Path, reinsert: bool
) -> None:
    """An object read after it was written outlives its segment's reclaim (appended anew,
    counted), while its unread neighbours go; with reinsert=False it goes with them."""
    backend = await open_disk(tmp_path, capacity=CAP, segment_bytes=SEG, reinsert=reinsert)
    first = keys_of(18)
    await put_each(backend, tmp_path, first)
    origin = segment_of(backend, "k001")
    neighbours = [k for k in first if segment_of(backend, k) == origin and k != "k001"]
    assert len(neighbours) >= 3
    assert await found(backend, ["k001"]) == ["k001"]  # read once: hot
    later = keys_of(60, "n")
    for i, key in enumerate(later):  # until the read segment's turn comes
        await put_each(backend, tmp_path, [key])
        if origin not in backend.catalog.index.live_bytes and i > 0:
            break
    assert not any(p.name == f"w000-{origin & 0xFFFFFFFF:08x}.seg" for p in segment_files(tmp_path))
    stats = await backend.stats()
    assert await found(backend, neighbours) == []
    if reinsert:
        assert await found(backend, ["k001"]) == ["k001"] and stats["reinserted"] >= 1
        assert segment_of(backend, "k001") != origin
    else:
        assert await found(backend, ["k001"]) == [] and stats["reinserted"] == 0
    await backend.close()
    reader = await open_disk(tmp_path, read_only=True)
    assert await found(reader, ["k001"]) == (["k001"] if reinsert else [])
    await reader.close()


@pytest.mark.asyncio
async def test_compaction_empties_mostly_dead_segments(tmp_path: pathlib.Path) -> None:
    """Deletes leave three segments mostly dead and one a third dead: compaction moves the
    live records of the three out and frees them, the other stays; every live object reads
    back exact, before and after a reopen, and nothing deleted comes back."""
    backend = await open_disk(tmp_path, segment_bytes=SEG)
    keys = keys_of(36)
    await put_each(backend, tmp_path, keys)
    codes = sorted({segment_of(backend, k) for k in keys})
    by_segment = {c: [k for k in keys if segment_of(backend, k) == c] for c in codes}
    mostly, third = codes[:3], codes[3]
    assert all(len(by_segment[c]) == 6 for c in codes[:4])
    doomed = [k for c in mostly for k in by_segment[c][1:]] + by_segment[third][:2]
    assert await backend.delete(doomed) == [True] * len(doomed)
    live = [k for k in keys if k not in doomed]
    count, freed = await backend.compact_segments(min_dead=0.5)
    assert (count, freed) == (3, 3 * SEG)
    names = {p.name for p in segment_files(tmp_path)}
    assert not any(f"w000-{c & 0xFFFFFFFF:08x}.seg" in names for c in mostly)
    assert segment_of(backend, by_segment[third][-1]) == third  # left where it was
    assert all(segment_of(backend, by_segment[c][0]) not in mostly for c in mostly)
    assert await found(backend, keys) == live
    await backend.close()
    for read_only in (True, False):
        reopened = await open_disk(tmp_path, read_only=read_only)
        assert sorted([i.key async for i in reopened.scan()]) == live
        assert await found(reopened, keys) == live
        await reopened.close()


@pytest.mark.asyncio
async def test_reinsertion_under_load_stays_within_capacity(tmp_path: pathlib.Path) -> None:
    """Puts with reads of recent keys in between: reclaims reinsert what was read, and the
    segments on disk still never exceed capacity plus one segment; no wrong bytes."""
    backend = await open_disk(tmp_path, capacity=CAP, segment_bytes=SEG)
    keys = keys_of(150)
    for i, key in enumerate(keys):
        await put_each(backend, tmp_path, [key])
        if i % 3 == 2:
            await found(backend, keys[i - 2 : i])
    stats = await backend.stats()
    assert stats["reclaimed_segments"] > 10 and stats["reinserted"] > 10
    assert stats["put_no_room"] == 0
    alive = await found(backend, keys)
    assert keys[-1] in alive and len(alive) == stats["objects"]
    await backend.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("other", ["delete", "newer_put"])
async def test_a_compaction_does_not_undo_another_writers_change(
    tmp_path: pathlib.Path, other: str
) -> None:
    """Writer B deletes (or writes anew) an object after writer A looked it up for a
    compaction and before A appended its copy (the interleaving is forced: B acts from
    inside A's copy step). A's copy keeps the object's old sequence, so B's change wins in
    A's index, in B's, and in a store reopened from the logs; before, the copy took a new
    sequence and brought the deleted object back, or hid B's newer bytes."""
    a = await open_disk(tmp_path, segment_bytes=SEG)
    keys = keys_of(12)
    await put_each(a, tmp_path, keys)
    first = [k for k in keys if segment_of(a, k) == segment_of(a, keys[0])]
    survivor, rest = first[0], first[1:]
    assert await a.delete(rest) == [True] * len(rest)
    b = await open_disk(tmp_path, segment_bytes=SEG)
    assert await found(b, [survivor]) == [survivor]
    newer = b"newer bytes of " + survivor.encode()
    assert a._reclaimer is not None and b._appender is not None
    copy = a._reclaimer._copy

    def b_acts_then_copy(code: int, records: list) -> int:  # type: ignore[type-arg]
        if other == "delete":
            assert b._locked(b._appender.delete, [survivor]) == [True]
        else:
            assert b._locked(b._appender.put, [survivor], [[memoryview(newer)]]) == [True]
        return copy(code, records)

    a._reclaimer._copy = b_acts_then_copy  # type: ignore[method-assign]
    assert await a.compact_segments(min_dead=0.5) == (1, SEG)
    assert a._reclaimer.counts["reinserted"] == 0  # a compaction moves, it does not reinsert
    want = None if other == "delete" else newer
    a.catalog.last_refresh = 0.0  # A reads B's log at its next call, as after REFRESH_S
    for backend in (a, b):
        assert await backend.get([survivor], size_hint=OBJ) == [want]
    await a.close()
    await b.close()
    for read_only in (True, False):
        reopened = await open_disk(tmp_path, read_only=read_only)
        assert await reopened.get([survivor], size_hint=OBJ) == [want]
        assert await found(reopened, [k for k in keys if k not in first]) == [
            k for k in keys if k not in first
        ]
        await reopened.close()


@pytest.mark.asyncio
async def test_a_reader_open_during_a_compaction_follows_the_moved_records(
    tmp_path: pathlib.Path,
) -> None:
    """A reader that indexed the records where they were finds them where the compaction
    moved them: a MOVE of a record's own sequence replaces the entry it had."""
    writer = await open_disk(tmp_path, segment_bytes=SEG)
    keys = keys_of(24)
    await put_each(writer, tmp_path, keys)
    doomed = [k for k in keys if int(k[1:]) % 6]  # five of every six records
    assert await writer.delete(doomed) == [True] * len(doomed)
    live = [k for k in keys if k not in doomed]
    reader = await open_disk(tmp_path, read_only=True)
    before = {k: segment_of(reader, k) for k in live}
    written = {i.key: i.mtime async for i in writer.scan("")}
    count, _ = await writer.compact_segments(min_dead=0.5)
    assert count >= 3
    reader.catalog.last_refresh = 0.0  # reads the writer's log at its next call
    assert await found(reader, keys) == live
    assert any(segment_of(reader, k) != before[k] for k in live)
    # A move is not a write: the write time (what --max-age expires by) stays.
    for backend in (writer, reader):
        assert {i.key: i.mtime async for i in backend.scan("")} == written
    await writer.close()
    await reader.close()
