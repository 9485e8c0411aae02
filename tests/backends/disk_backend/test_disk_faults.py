"""The disk backend given bad input: directories that are no store, damaged markers, a full
disk, segments and logs cut or scribbled on by hand, planted links, empty values.

Each must end as a one-line typed error out of ``open``, or as counted misses: never wrong
bytes, never an exception out of ``get`` or ``put``.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import pathlib
import shutil
from typing import Any

import pytest
from disk_kit import (
    KEYS,
    KIB,
    expect,
    fill_up,
    log_files,
    one_line,
    open_disk,
    outside_dir,
    segment_files,
    stored,
    tree_of,
    value_of,
    without_closing_snapshot,
)
from file_kit import tiny_tmpfs

from hicache.backends.disk import DiskBackend
from hicache.backends.disk.format import FORMAT_VERSION, RECORD_HEADER, parse_record_header
from hicache.backends.file import FileBackend, FileConfig
from hicache.errors import BackendUnavailableError, ConfigError, InvalidKeyError

tmpfs = pytest.fixture(tiny_tmpfs, name="tmpfs")
outside = pytest.fixture(outside_dir, name="outside")
NEWER = json.dumps({"format": "hicache-disk", "version": FORMAT_VERSION + 1, "segment_bytes": 1})


# ----- not a store ------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_file_store_is_not_a_disk_store(tmp_path: pathlib.Path) -> None:
    """A file:// store's fan-out directories: refused, by a writer and a reader, untouched."""
    files = await FileBackend.open(FileConfig(root=str(tmp_path)))
    assert await files.put(["page"], [b"data"]) == [True]
    await files.close()
    before = tree_of(tmp_path)
    for read_only in (False, True):
        with pytest.raises(BackendUnavailableError) as exc:
            await open_disk(tmp_path, read_only=read_only)
        assert str(tmp_path) in one_line(exc)
    assert tree_of(tmp_path) == before and not (tmp_path / "segments").exists()


@pytest.mark.parametrize(
    ("marker", "match"),
    [
        (NEWER, f"format {FORMAT_VERSION + 1}"),
        ('{"format": "hicache-disk", "vers', "damaged"),
        ("\x00\xff\xfe binary", "damaged"),
        ("[1, 2]", "damaged"),
        ('{"format": "other", "version": 1, "segment_bytes": 65536}', "not a hicache disk"),
        ('{"format": "hicache-disk", "version": 1, "segment_bytes": 0}', "damaged"),
        (None, "Is a directory"),  # a directory named like the marker
        ("link", "cannot read"),  # a link to a good marker elsewhere
    ],
)
@pytest.mark.asyncio
async def test_bad_markers(tmp_path: pathlib.Path, marker: str | None, match: str) -> None:
    """A marker of a newer format (named in the error), damaged or planted: a one-line
    BackendUnavailableError for a writer and a reader alike."""
    root = tmp_path / "store"
    await stored(root, KEYS[:2])
    path = root / "hicache-disk.json"
    if marker is None:
        path.unlink()
        path.mkdir()
    elif marker == "link":
        shutil.move(path, tmp_path / "elsewhere.json")
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_text(marker)
    for read_only in (False, True):
        with pytest.raises(BackendUnavailableError, match=match) as exc:
            await open_disk(root, read_only=read_only)
        one_line(exc)


@pytest.mark.asyncio
async def test_segment_size_is_the_stores(tmp_path: pathlib.Path) -> None:
    """Another segment_bytes on a second open is a ConfigError; the same or none opens."""
    await stored(tmp_path, KEYS[:1])
    with pytest.raises(ConfigError, match="segment_bytes=65536") as exc:
        await open_disk(tmp_path, segment_bytes=1 << 20)
    one_line(exc)
    for options in ({"segment_bytes": 64 * KIB}, {}):
        backend = await open_disk(tmp_path, **options)
        await expect(backend, KEYS[:1], [])
        await backend.close()


# ----- a full disk ------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_full_disk_fails_puts_and_keeps_objects(tmpfs: pathlib.Path) -> None:
    """Puts on a full tmpfs return False and count enospc; what was stored reads back, before
    and after a reopen."""
    backend = await open_disk(tmpfs, segment_bytes=64 * KIB)
    results = [await backend.put([f"k{i}"], [value_of(f"k{i}", 1, 30000)]) for i in range(80)]
    ok = [f"k{i}" for i, r in enumerate(results) if r == [True]]
    assert 10 < len(ok) < 80 and results[-1] == [False]
    stats = await backend.stats()
    assert stats["enospc"] >= 1 and stats["put_errors"] == stats["enospc"]
    assert await backend.get(ok, size_hint=32 * KIB) == [value_of(k, 1, 30000) for k in ok]
    await backend.close()  # its snapshot may not fit: a warning, not an error
    reader = await open_disk(tmpfs, read_only=True)
    assert await reader.get(ok, size_hint=32 * KIB) == [value_of(k, 1, 30000) for k in ok]
    await reader.close()


@pytest.mark.asyncio
async def test_full_disk_during_log_appends_and_rotations(tmpfs: pathlib.Path) -> None:
    """The disk fills up under small puts: log appends and the rotations snapshots make fail
    (False, counted, never an exception); once space is back, puts work again and a reopen
    finds every acknowledged put: no failed append left a torn record in the middle."""
    root = tmpfs / "store"
    backend = await open_disk(root, segment_bytes=64 * KIB, snapshot_records=5)
    assert await backend.put(["first"], [b"f" * 100]) == [True]
    fill_up(tmpfs / "filler")
    acked = ["first"]
    for i in range(300):
        if await backend.put([f"small-{i}"], [b"v" * 10]) == [True]:
            acked.append(f"small-{i}")
    assert (await backend.stats())["enospc"] >= 1
    os.unlink(tmpfs / "filler")
    for i in range(300, 320):
        assert await backend.put([f"small-{i}"], [b"v" * 10]) == [True]
        acked.append(f"small-{i}")
    await backend.close()
    reader = await open_disk(root, read_only=True)
    assert sorted([info.key async for info in reader.scan()]) == sorted(acked)
    assert (await reader.stats())["log_gaps"] == 0
    await reader.close()


@pytest.mark.asyncio
async def test_log_append_cut_short(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log append that wrote half its record then failed: the put is False, the half is cut
    off, and the puts after it are found by a reopen that replays the log."""
    backend = await open_disk(tmp_path, segment_bytes=64 * KIB)
    assert await backend.put(["before"], [b"b"]) == [True]
    log_fills_up(monkeypatch, backend, half_once=True)
    assert await backend.put(["lost"], [b"l"]) == [False]
    assert (await backend.stats())["enospc"] == 1
    assert await backend.put(["after"], [b"a"]) == [True]
    without_closing_snapshot(backend)
    await backend.close()
    reader = await open_disk(tmp_path, read_only=True)
    assert await reader.get(["before", "lost", "after"]) == [b"b", None, b"a"]
    await reader.close()


def log_fills_up(monkeypatch: pytest.MonkeyPatch, backend: DiskBackend, half_once: bool) -> None:
    """Make writes to the backend's open log fail with ENOSPC: every one, or the next one
    only, after writing half its bytes."""
    assert backend._appender is not None
    log_fd, real_write = backend._appender.log._fd, os.write

    def full(fd: int, data: Any) -> int:
        if fd != log_fd:
            return real_write(fd, data)
        if half_once:
            monkeypatch.setattr(os, "write", real_write)
            real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)


# ----- segments damaged by hand -----------------------------------------------------------------
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.asyncio
async def test_segment_truncated_by_hand(tmp_path: pathlib.Path, direct: bool) -> None:
    """The records past the cut are misses, counted and forgotten; those before it exact
    (buffered and O_DIRECT reads alike)."""
    await stored(tmp_path)
    first = segment_files(tmp_path)[0]
    size = RECORD_HEADER + 2  # where the payload of a two-letter key starts in its record
    reader = await open_disk(tmp_path, read_only=True)
    entries = [reader.catalog.index.get(k) for k in KEYS]
    await reader.close()
    in_first = [k for k, e in zip(KEYS, entries, strict=True) if e and e[0] == entries[0][0]]
    assert len(in_first) >= 4
    third = entries[KEYS.index(in_first[2])]
    assert third is not None
    os.truncate(first, third[1] + size + third[2] // 2)  # half way through the third payload
    backend = await open_disk(tmp_path, direct=direct)
    await expect(backend, KEYS[:2] + KEYS[len(in_first) :], in_first[2:])
    assert (await backend.stats())["bad_records"] == len(in_first) - 2
    await backend.close()
    backend = await open_disk(tmp_path, read_only=True)  # still misses after a reopen
    await expect(backend, KEYS[:2], in_first[2:])
    await backend.close()


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.asyncio
async def test_segment_scribbled_on_by_hand(tmp_path: pathlib.Path, direct: bool) -> None:
    """Garbage over part of a segment: the objects it touches are misses (bad_records), all
    the others exact; a reopen agrees."""
    await stored(tmp_path)
    reader = await open_disk(tmp_path, read_only=True)
    entries = {k: reader.catalog.index.get(k) for k in KEYS}
    await reader.close()
    k3, k5 = entries["k3"], entries["k5"]
    assert k3 is not None and k5 is not None and k3[0] == k5[0]
    seg = next(p for p in segment_files(tmp_path) if p.stat().st_size > k5[1])
    with open(seg, "r+b") as f:
        f.seek(k3[1] + 100)  # the payload of k3 ...
        f.write(os.urandom(k5[1] + 20 - f.tell()))  # ... to the header of k5
    backend = await open_disk(tmp_path, direct=direct)
    bad = ["k3", "k4", "k5"]
    await expect(backend, [k for k in KEYS if k not in bad], bad)
    assert (await backend.stats())["bad_records"] == 3
    assert await backend.put(["k4"], [value_of("k4", 1, 6000)]) == [True]  # stored anew
    await backend.close()
    backend = await open_disk(tmp_path, read_only=True)
    await expect(backend, [k for k in KEYS if k not in ("k3", "k5")], ["k3", "k5"])
    await backend.close()


@pytest.mark.asyncio
async def test_damaged_record_found_while_the_log_cannot_grow(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read finds a damaged record while the disk is full, so the DELETE that tells the
    other processes cannot be logged: still a counted miss, never an exception from get."""
    await stored(tmp_path, KEYS[:3])
    backend = await open_disk(tmp_path)
    entry = backend.catalog.index.get("k1")
    assert entry is not None and backend._appender is not None
    with open(segment_files(tmp_path)[0], "r+b") as f:
        f.seek(entry[1] + RECORD_HEADER + 2)
        f.write(b"scribble")
    log_fills_up(monkeypatch, backend, half_once=False)
    await expect(backend, ["k0", "k2"], ["k1"])
    assert (await backend.stats())["bad_records"] == 1
    await backend.close()


# ----- index files damaged by hand --------------------------------------------------------------
@pytest.mark.asyncio
async def test_logs_deleted_without_a_snapshot(tmp_path: pathlib.Path) -> None:
    """Every generation of the slot's log gone, no snapshot: misses, then a working store."""
    backend = await open_disk(tmp_path, segment_bytes=64 * KIB, snapshot_records=4)
    for key in KEYS:
        assert await backend.put([key], [value_of(key, 1, 6000)]) == [True]
    without_closing_snapshot(backend)
    await backend.close()
    for path in [*log_files(tmp_path), tmp_path / "index" / "snapshot"]:
        path.unlink()
    for read_only in (True, False):
        backend = await open_disk(tmp_path, read_only=read_only)
        await expect(backend, [], KEYS)
        assert [i async for i in backend.scan()] == []
        if not read_only:
            assert await backend.put(["k0"], [value_of("k0", 1, 6000)]) == [True]
        await backend.close()
    backend = await open_disk(tmp_path, read_only=True)
    await expect(backend, ["k0"], KEYS[1:])
    await backend.close()


@pytest.mark.asyncio
async def test_logs_deleted_under_a_snapshot(tmp_path: pathlib.Path) -> None:
    """Every log generation of the slot gone, the snapshot there: its objects are found, and
    a reader open from before sees what the writer taking the slot puts afterwards (the
    writer starts past the generation the snapshot names, not over at the first)."""
    await stored(tmp_path, snapshot_records=3)
    for path in log_files(tmp_path):
        path.unlink()
    writer = await open_disk(tmp_path)
    reader = await open_disk(tmp_path, read_only=True)
    await expect(reader, KEYS, [])
    assert await writer.put(["new"], [value_of("new", 1, 6000)]) == [True]
    await expect(reader, ["new"], [])
    await writer.close()
    await expect(reader, [*KEYS, "new"], [])
    await reader.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "directory"])
@pytest.mark.asyncio
async def test_damaged_snapshot_falls_back_to_the_logs(tmp_path: pathlib.Path, damage: str) -> None:
    """The snapshot damaged: counted, and the objects the logs still name are found; those
    only the snapshot named (their logs were removed when it was written) are misses."""
    await stored(tmp_path, KEYS[:6])  # its close writes a snapshot and drops the logs
    backend = await open_disk(tmp_path)
    for key in KEYS[6:]:
        assert await backend.put([key], [value_of(key, 1, 6000)]) == [True]
    without_closing_snapshot(backend)
    await backend.close()
    snapshot = tmp_path / "index" / "snapshot"
    if damage == "garbage":
        snapshot.write_bytes(os.urandom(snapshot.stat().st_size))
    elif damage == "truncated":
        os.truncate(snapshot, snapshot.stat().st_size - 1)
    else:
        snapshot.unlink()
        snapshot.mkdir()
    backend = await open_disk(tmp_path, read_only=True)
    assert (await backend.stats())["snapshot_damaged"] == 1
    await expect(backend, KEYS[6:], KEYS[:6])
    await backend.close()


# ----- planted links ------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_links_in_place_of_store_files(tmp_path: pathlib.Path, outside: pathlib.Path) -> None:
    """A segment, the last log generation and the snapshot moved outside, links to them left
    in their place: never followed, so what they held is misses (counted), before and after a
    writer's puts and snapshots; nothing outside is read back, written or truncated."""
    root = tmp_path / "store"
    await stored(root)
    backend = await open_disk(root)
    assert await backend.put(["late"], [b"in the log only"]) == [True]
    without_closing_snapshot(backend)
    await backend.close()
    for path in [segment_files(root)[0], log_files(root)[-1], root / "index" / "snapshot"]:
        shutil.move(path, outside / path.name)
        path.symlink_to(outside / path.name)
    before = tree_of(outside)
    backend = await open_disk(root, snapshot_records=2)
    stats = await backend.stats()
    assert stats["snapshot_damaged"] == 1 and stats["objects"] == 0
    assert await backend.get(["k0", "late"]) == [None, None]
    for i in range(6):  # new segments, rotations, snapshots
        assert await backend.put([f"new{i}"], [b"n" * 30000]) == [True]
    await backend.close()
    backend = await open_disk(root, read_only=True)
    assert await backend.get(["k0", "late", "new5"]) == [None, None, b"n" * 30000]
    await backend.close()
    assert tree_of(outside) == before


@pytest.mark.asyncio
async def test_links_where_new_files_go(tmp_path: pathlib.Path, outside: pathlib.Path) -> None:
    """Links named like the writer's next segment, its next log generation and another slot's
    lock file: puts fail (False, counted) or step over them, never raise, never follow."""
    root = tmp_path / "store"
    await stored(root, KEYS[:2])
    (gen,) = [int(p.name.split(".")[1], 16) for p in log_files(root)]
    number = int.from_bytes((root / "locks" / "w000.lock").read_bytes()[:8], "little")
    for name in (f"segments/w000-{number:08x}.seg", f"index/w000.{gen + 2:08x}.log",
                 "locks/w001.lock"):  # fmt: skip
        (root / name).symlink_to(outside / "victim")
    before = tree_of(outside)
    backend = await open_disk(root, snapshot_records=2)
    other = await open_disk(root)
    assert other._appender is not None and other._appender.slot == 2  # slot 1's lock: a link
    results = [await backend.put([f"new{i}"], [b"n" * 100]) for i in range(6)]
    assert results[0] == [False] and [True] in results  # that segment's name was taken
    assert (await backend.stats())["put_errors"] >= 1
    await expect(backend, KEYS[:2], [])
    await other.close()
    await backend.close()
    assert tree_of(outside) == before


@pytest.mark.asyncio
async def test_store_folders_that_are_links(tmp_path: pathlib.Path, outside: pathlib.Path) -> None:
    """segments/ (or index/, locks/) a link to a directory outside: a one-line refusal."""
    for name in ("segments", "index", "locks"):
        root = tmp_path / f"store-{name}"
        await stored(root, KEYS[:1])
        shutil.rmtree(root / name)
        (root / name).symlink_to(outside)
        for read_only in (False, True):
            with pytest.raises(BackendUnavailableError, match=name) as exc:
                await open_disk(root, read_only=read_only)
            one_line(exc)
    assert tree_of(outside) == {"victim": tree_of(outside)["victim"]}


# ----- empty keys and values ----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_empty_keys_refused_and_empty_values_kept(tmp_path: pathlib.Path) -> None:
    """An empty key is an InvalidKeyError everywhere; an empty value is stored, listed with
    size 0, read back empty, and kept through a reopen from the logs and from a snapshot."""
    backend = await open_disk(tmp_path, segment_bytes=64 * KIB)
    for call in (backend.exists([""]), backend.put([""], [b"x"]), backend.delete([""])):
        with pytest.raises(InvalidKeyError):
            await call
    assert await backend.put(["empty", "also", "full"], [b"", [b"", b""], b"x"]) == [True] * 3
    assert await backend.get_into(["empty", "also"], [bytearray(0), bytearray(4)]) == [0, 0]
    assert {i.key: i.size async for i in backend.scan()} == {"empty": 0, "also": 0, "full": 1}
    without_closing_snapshot(backend)
    await backend.close()
    for n in range(2):  # from the log (a put: a snapshot at close), then from that snapshot
        backend = await open_disk(tmp_path)
        assert await backend.get(["empty", "also", "full"]) == [b"", b"", b"x"]
        assert await backend.put([f"more{n}"], [b""]) == [True]
        await backend.close()
        assert (tmp_path / "index" / "snapshot").is_file()


# ----- large records, read in pieces --------------------------------------------------------------
def _large_values() -> dict[str, bytes]:
    """Records past PIECE_BYTES (read and hashed piece by piece), one ending mid-piece."""
    from hicache.backends.disk.reads import PIECE_BYTES

    sizes = {"big-a": 3 * PIECE_BYTES + 5, "big-b": PIECE_BYTES + 1, "big-c": 2 * PIECE_BYTES}
    return {k: os.urandom(n) for k, n in sizes.items()}


@pytest.mark.parametrize("io_threads", [1, 2])
@pytest.mark.asyncio
async def test_large_records_read_in_pieces_into_split_buffers(
    tmp_path: pathlib.Path, io_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every byte of a record read in pieces lands in its place, across buffers whose edges
    fall anywhere in the pieces."""
    from hicache.backends.disk import reads
    from hicache.backends.disk.reads import PIECE_BYTES

    values = _large_values()
    backend = await open_disk(tmp_path, io_threads=io_threads)
    assert await backend.put(list(values), list(values.values())) == [True] * 3
    sizes: list[int] = []
    real = os.preadv

    def counted(fd: int, iov: list[memoryview], *rest: int) -> int:
        sizes.append(sum(v.nbytes for v in iov))
        return real(fd, iov, *rest)

    monkeypatch.setattr(reads.os, "preadv", counted)
    for cuts in ([], [7], [4096, (1 << 20) + 3]):
        targets = []
        for value in values.values():
            edges = [0, *[c for c in cuts if c < len(value)], len(value)]
            targets.append([bytearray(b - a) for a, b in itertools.pairwise(edges)])
        got = await backend.get_into(list(values), targets)
        assert got == [len(v) for v in values.values()]
        assert [b"".join(t) for t in targets] == list(values.values())
    # Each record's header first, then its payload piece by piece: no read larger than a
    # piece (a pass: 1 + 4, 1 + 2 and 1 + 2 reads).
    assert sizes and max(sizes) <= PIECE_BYTES
    assert len(sizes) == 3 * (5 + 3 + 3)
    await backend.close()


@pytest.mark.parametrize("where", ["first piece", "last piece", "header", "cut"])
@pytest.mark.asyncio
async def test_a_large_record_damaged_in_any_piece_is_a_miss(
    tmp_path: pathlib.Path, where: str
) -> None:
    """A flipped byte in any piece, a damaged header or a segment cut inside the record: the
    record is a miss (counted, forgotten), its neighbours exact."""
    values = _large_values()
    backend = await open_disk(tmp_path)
    assert await backend.put(list(values), list(values.values())) == [True] * 3
    entry = backend.catalog.index.get("big-a")
    await backend.close()
    assert entry is not None
    _, offset, length, _ = entry
    seg = next(p for p in segment_files(tmp_path) if p.stat().st_size > offset)
    with open(seg, "rb") as f:
        f.seek(offset)
        header = parse_record_header(f.read(RECORD_HEADER + 64), b"big-a")
    assert header is not None
    payload = offset + RECORD_HEADER + len("big-a") + header.gap
    if where == "cut":
        os.truncate(seg, payload + length - 100)  # the others follow it: they go too
    else:
        at = {
            "first piece": payload + 10,
            "last piece": payload + length - 1,
            "header": offset + 20,
        }
        with open(seg, "r+b") as f:
            f.seek(at[where])
            byte = f.read(1)
            f.seek(at[where])
            f.write(bytes([byte[0] ^ 0xFF]))
    backend = await open_disk(tmp_path)
    got = await backend.get(list(values), size_hint=4 << 20)
    assert got[0] is None
    if where != "cut":
        assert got[1:] == list(values.values())[1:]
    assert (await backend.stats())["bad_records"] == (1 if where != "cut" else 3)
    assert await backend.exists(["big-a"]) == [False]
    await backend.close()


@pytest.mark.parametrize("key", ["k", "key-of-13-ch", "a-key-of-twenty-chars"])
@pytest.mark.asyncio
async def test_a_large_records_last_piece_starts_on_a_64_byte_boundary(
    tmp_path: pathlib.Path, key: str
) -> None:
    """A page after its header (two pieces, as the engines' adapters put them): the page's
    first byte lands on a 64-byte boundary of the segment file, whatever the key's length
    and wherever the record starts, so the kernel's copy to an aligned buffer runs aligned;
    the gap is in the header, and the bytes read back (also by a reclaim's move and a walk)
    are exact."""
    from hicache.backends.disk.segments import Found, walk_segment

    backend = await open_disk(tmp_path)
    small = await backend.put(["small"], [b"x" * 77])  # the large record starts past it
    head, page = os.urandom(61), os.urandom((2 << 20) + 3)
    assert small == [True] and await backend.put([key], [[head, page]]) == [True]
    _, offset, length, _ = backend.catalog.index.get(key)
    assert length == len(head) + len(page)
    seg = next(p for p in segment_files(tmp_path) if p.stat().st_size > offset)
    with open(seg, "rb") as f:
        f.seek(offset)
        record = f.read(RECORD_HEADER + len(key) + 64)
    header = parse_record_header(record, key.encode())
    assert header is not None and 0 <= header.gap < 64
    page_at = offset + RECORD_HEADER + len(key) + header.gap + len(head)
    assert page_at % 64 == 0
    assert await backend.get([key], size_hint=4 << 20) == [head + page]
    assert await backend.peek([key], 100) == [(head + page)[:100]]
    with open(seg, "rb") as f:
        found = [r for r in walk_segment(f.fileno(), seg.stat().st_size, payloads=True)]
    assert [(r.key, r.intact) for r in found if isinstance(r, Found)] == [
        ("small", True),
        (key, True),
    ]
    await backend.close()
