"""On-disk formats of the ``3fs`` backend: the slot header and the key-to-slot index log.

Slot header: the first ``SLOT_HEADER`` bytes of every slot say which write put its bytes there
(a sequence number, the object's size and the hash of its key, with a CRC). A read checks it
against the index entry, so a slot overwritten after a crash, or an index record that outlived
its data, reads as a miss instead of as another object's bytes. The header takes a whole 4 KiB
block so the payload stays block-aligned (O_DIRECT and 3FS chunk alignment).

Index log: fixed-size records (``RECORD`` bytes, one per put or delete), each with its own CRC,
after a header record that fixes the slot geometry. Fixed sizes mean a damaged record is
skipped without losing its neighbours and a torn tail (a partial last record) is simply
ignored; replay then rewrites the log, so appends always start on a record boundary.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from hicache.backends.hf3fs.posix import open_store_file

__all__ = [
    "RECORD",
    "SLOT_HEADER",
    "Entry",
    "Geometry",
    "GeometryMismatchError",
    "IndexLog",
    "Replay",
    "encode_delete",
    "encode_put",
    "key_hash",
    "pack_slot_header",
    "slot_header_matches",
]

SLOT_HEADER = 4096
RECORD = 512
_SLOT = struct.Struct("<8sQQQ")  # magic, seq, size, key hash; a CRC32 of these follows
_SLOT_MAGIC = b"HC3FSLT1"
_CRC = struct.Struct("<I")
_REC = struct.Struct("<4sBBHIQQd")  # magic, op, key length, 0, slot, size, seq, mtime
_REC_MAGIC = b"H3IR"
_FILE = struct.Struct("<8sIQQ")  # magic, version, slot bytes, slots
_FILE_MAGIC = b"HC3FSIDX"
_VERSION = 1
_PUT, _DELETE = 1, 2
_BODY = RECORD - _CRC.size


def key_hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def pack_slot_header(block: memoryview, seq: int, size: int, khash: int) -> None:
    """Fill a zeroed header block for a slot write (the payload follows it)."""
    _SLOT.pack_into(block, 0, _SLOT_MAGIC, seq, size, khash)
    _CRC.pack_into(block, _SLOT.size, zlib.crc32(block[: _SLOT.size]))


def slot_header_matches(block: memoryview | bytearray, seq: int, size: int, khash: int) -> bool:
    """Whether a slot's header names exactly this write; a zeroed (freed) slot never does.

    Its fields equal to what that write packed is the whole test. The CRC after them is for a
    reader with no entry to compare against (a slot scanner); this check needs no more.
    """
    return bytes(memoryview(block)[: _SLOT.size]) == _SLOT.pack(_SLOT_MAGIC, seq, size, khash)


@dataclass(frozen=True, slots=True)
class Geometry:
    slot_bytes: int  # the largest object a slot holds
    slots: int


@dataclass(slots=True)
class Entry:
    """Where one key's object is: its slot, size, the write's sequence number and time."""

    slot: int
    size: int
    seq: int
    mtime: float


def _record(op: int, key: str, slot: int, size: int, seq: int, mtime: float) -> bytes:
    raw = key.encode()
    body = bytearray(_BODY)
    _REC.pack_into(body, 0, _REC_MAGIC, op, len(raw), 0, slot, size, seq, mtime)
    body[_REC.size : _REC.size + len(raw)] = raw
    return bytes(body) + _CRC.pack(zlib.crc32(body))


def encode_put(key: str, entry: Entry) -> bytes:
    return _record(_PUT, key, entry.slot, entry.size, entry.seq, entry.mtime)


def encode_delete(key: str, seq: int) -> bytes:
    return _record(_DELETE, key, 0, 0, seq, 0.0)


def _decode(raw: memoryview, geometry: Geometry) -> tuple[int, str, Entry] | None:
    """(op, key, entry) of one record, or None when it is damaged or impossible."""
    (crc,) = _CRC.unpack_from(raw, _BODY)
    if zlib.crc32(raw[:_BODY]) != crc:
        return None
    magic, op, klen, _, slot, size, seq, mtime = _REC.unpack_from(raw, 0)
    if magic != _REC_MAGIC or op not in (_PUT, _DELETE) or not 0 < klen <= _BODY - _REC.size:
        return None
    if op == _PUT and (slot >= geometry.slots or size > geometry.slot_bytes):
        return None
    try:
        key = bytes(raw[_REC.size : _REC.size + klen]).decode("ascii")
    except UnicodeDecodeError:
        return None
    return op, key, Entry(slot, size, seq, mtime)


@dataclass(slots=True)
class Replay:
    """What replaying a log found: live entries in write order, and what was wrong."""

    entries: OrderedDict[str, Entry]
    records: int = 0
    corrupt: int = 0
    torn_bytes: int = 0
    max_seq: int = 0


def replay(data: memoryview, geometry: Geometry) -> Replay:
    """Apply every intact record in order; a slot claimed again drops its earlier key."""
    out = Replay(OrderedDict())
    holder: dict[int, str] = {}  # slot -> key, to resolve two live claims on one slot
    usable = len(data) - len(data) % RECORD
    out.torn_bytes = len(data) - usable
    for start in range(RECORD, usable, RECORD):
        decoded = _decode(data[start : start + RECORD], geometry)
        if decoded is None:
            out.corrupt += 1
            continue
        out.records += 1
        op, key, entry = decoded
        out.max_seq = max(out.max_seq, entry.seq)
        old = out.entries.pop(key, None)
        if old is not None:
            holder.pop(old.slot, None)
        if op == _PUT:
            stale = holder.pop(entry.slot, None)
            if stale is not None:
                del out.entries[stale]
            out.entries[key] = entry
            holder[entry.slot] = key
    return out


def _file_header(geometry: Geometry) -> bytes:
    head = _FILE.pack(_FILE_MAGIC, _VERSION, geometry.slot_bytes, geometry.slots)
    body = head.ljust(_BODY, b"\0")
    return body + _CRC.pack(zlib.crc32(body))


class GeometryMismatchError(Exception):
    """The log was written for another slot geometry; ``found`` is what it says."""

    def __init__(self, found: Geometry) -> None:
        super().__init__(f"slot_bytes={found.slot_bytes}, slots={found.slots}")
        self.found = found


def _read_geometry(data: memoryview) -> Geometry | None:
    """The geometry a log's header records; None when the header itself is damaged."""
    if len(data) < RECORD or zlib.crc32(data[:_BODY]) != _CRC.unpack_from(data, _BODY)[0]:
        return None
    magic, version, slot_bytes, slots = _FILE.unpack_from(data, 0)
    if magic != _FILE_MAGIC or version != _VERSION:
        return None
    return Geometry(slot_bytes, slots)


def _read_whole(path: str) -> bytes:
    fd = open_store_file(path, os.O_RDONLY)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class IndexLog:
    """The append-only log of one rank. Not thread-safe: the backend calls it under its lock."""

    def __init__(self, path: str, geometry: Geometry, fsync: bool) -> None:
        self.path = path
        self.geometry = geometry
        self.fsync = fsync
        self.records = 0  # records in the file now, live or superseded
        self._fd = -1

    def load(self) -> Replay:
        """Replay the log (a missing or headless one is empty) and rewrite it if it was not clean.

        Raises :class:`GeometryMismatchError` for a log of another geometry: its slots would mean
        other byte ranges, so it is never reinterpreted.
        """
        try:
            data = memoryview(_read_whole(self.path))
        except FileNotFoundError:
            data = memoryview(b"")
        found = _read_geometry(data)
        if found is not None and found != self.geometry:
            raise GeometryMismatchError(found)
        result = replay(data, self.geometry) if found is not None else Replay(OrderedDict())
        damaged = found is None or result.corrupt or result.torn_bytes
        if damaged or result.records > len(result.entries):
            self.rewrite(result.entries)
        else:
            self.records = result.records
            self._fd = open_store_file(self.path, os.O_WRONLY | os.O_APPEND)
        return result

    def append(self, records: bytes) -> None:
        """Append whole records in one write, so a crash tears at most the last of them."""
        _write_all(self._fd, records)
        if self.fsync:
            os.fdatasync(self._fd)
        self.records += len(records) // RECORD

    def rewrite(self, entries: OrderedDict[str, Entry]) -> None:
        """Replace the log by one put record per live entry, in order (that keeps the LRU order).

        Written to a temporary file, synced, then renamed over the log: a crash leaves the old
        log or the new one, never a mix. The temporary file's descriptor goes on as the log's,
        so the log is never opened again by name after the rename.
        """
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):  # a crashed rewrite's, or a planted link
            os.unlink(tmp)  # unlinks the entry itself, never what a link points to
        fd = open_store_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        try:
            chunk = [_file_header(self.geometry)]
            for key, entry in entries.items():
                chunk.append(encode_put(key, entry))
                if len(chunk) >= 2048:
                    _write_all(fd, b"".join(chunk))
                    chunk.clear()
            _write_all(fd, b"".join(chunk))
            os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self._fd = fd
        self.records = len(entries)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
