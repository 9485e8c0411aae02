"""On-disk formats of the ``disk`` backend: pure packing and parsing, no I/O.

Three kinds of file, each self-describing so it can be checked on its own:

- **Segment** (``segments/wNNN-XXXXXXXX.seg``): a 64-byte header naming its writer slot and
  number, then records appended back to back, each 8-byte aligned. A record is a 40-byte
  header (magic, key length, flags, payload length, write sequence, xxh3 of the payload, CRC32
  of the header and key), the key, a gap of 0-63 zero bytes (its length in the flags' low six
  bits; only a record over ``LARGE_RECORD_BYTES`` has one), the payload and padding. The gap
  puts the start of the payload's last piece as the writer gave it (a page after its header)
  on a 64-byte boundary of the file: the kernel copies between the page cache and a caller's
  buffer at about half speed when the two are not aligned alike (9.5 against 15 GB/s here).
  A segment can be walked from its header to its end without any index (``verify`` and
  reclaim do), and a read checks the header it lands on against the index entry, so a stale
  or damaged entry reads as a miss.
  A large record whose payload is a hicache page (a well-formed page header for the payload's
  length: :func:`hicache.page_header.stored_payload_checksum`) is flagged ``PAGE_DIGEST`` and
  its header's xxh3 is the page's own: of the payload after the page header, the page header
  being checked by its own checksum. Every byte is still checked on a read, with one hash
  instead of two (the page's, which the codec checks anyway) and nothing hashed at the put
  (the codec hashed the page as it encoded it). A reader older than the flag reads such a
  record as damaged: a miss.
- **Index log** (``index/wNNN.GGGGGGGG.log``): a 32-byte header naming slot and generation,
  then frames, one per append, each a CRC32 over its records: PUT (key, segment, offset,
  length, sequence), DELETE (key, sequence), RECLAIM (a segment is gone), ROTATE (appends
  continue in the named generation). A torn or damaged frame ends a replay; nothing after it
  is trusted.
- **Snapshot** (``index/snapshot``): the merged index at a known point of every log, as one
  blob of keys and four little-endian int64 arrays, with an xxh3 of the whole.

Sequences are hybrid logical clocks in nanoseconds (the wall clock, never below one past the
largest sequence seen), so the newest write of a key wins whatever order logs are read in,
and a sequence doubles as the write time that ``scan`` reports.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum

import xxhash

from hicache.page_header import HEADER_SIZE, stored_payload_checksum

__all__ = [
    "FORMAT_VERSION",
    "LARGE_RECORD_BYTES",
    "LOG_HEADER",
    "LOG_RECORD",
    "MAX_GAP",
    "PAGE_DIGEST",
    "RECORD_HEADER",
    "SEGMENT_HEADER",
    "LogOp",
    "LogRecord",
    "RecordHeader",
    "Snapshot",
    "align8",
    "decode_log",
    "decode_snapshot",
    "encode_log_frame",
    "encode_log_record",
    "encode_snapshot",
    "log_frame",
    "log_header",
    "pack_record_header",
    "parse_log_header",
    "parse_record_header",
    "parse_segment_header",
    "payload_gap",
    "payload_hash",
    "payload_intact",
    "record_bytes",
    "record_digest",
    "segment_code",
    "segment_header",
    "split_code",
]

FORMAT_VERSION = 1

# Segment header: magic, version, slot, number, creation time; CRC32 of those; zero padding.
_SEG = struct.Struct("<8sHHIQ")
_SEG_MAGIC = b"HDSKSEG1"
SEGMENT_HEADER = 64
# Record header: magic, key length, flags, payload length, sequence, payload xxh3; then the
# CRC32 of those 32 bytes and the key, and 4 zero bytes.
_REC = struct.Struct("<4sHHQQQ")
_REC_CRC = struct.Struct("<I4x")
_REC_MAGIC = b"HDSR"
RECORD_HEADER = _REC.size + _REC_CRC.size  # 40
_GAP_BITS = 0x3F  # the flags' bits that hold the gap before the payload
PAGE_DIGEST = 0x40  # the flag of a record whose xxh3 is its page's (see above)
_FLAG_BITS = _GAP_BITS | PAGE_DIGEST  # the rest are zero
_ALIGN = 64
MAX_GAP = _ALIGN - 1  # the most zero bytes a record has between its key and its payload
# A record larger than this may have a gap before its payload (and is read on its own, its
# header first, in pieces: see reads.py).
LARGE_RECORD_BYTES = 1 << 20
# Log header: magic, version, slot, generation; CRC32 of those.
_LOG = struct.Struct("<8sHHQ")
_LOG_MAGIC = b"HDSKLOG1"
LOG_HEADER = 32
# Log frame: CRC32 of its body, body length, record count; then the records, each an op, a key
# length, sequence, segment code, offset and length, then the key.
_FRAME = struct.Struct("<IIH")
LOG_RECORD = struct.Struct("<BBQQQQ")
# Snapshot header: magic, version, entries, logs, keys blob bytes; xxh3 of everything after.
_SNAP = struct.Struct("<8sHIQQQ")
_SNAP_MAGIC = b"HDSKSNP1"
_SNAP_LOG = struct.Struct("<HQQ")  # slot, generation, offset


class LogOp(IntEnum):
    PUT = 1
    DELETE = 2
    RECLAIM = 3  # ``segment``: every entry in that segment is gone
    ROTATE = 4  # ``segment``: the generation appends continue in
    # A live record appended anew by a reclaim or a compaction. It keeps the sequence of the
    # put that wrote it, so a DELETE or a newer PUT of the key that another process made
    # meanwhile still wins; of two records of one sequence, the moved one is taken.
    MOVE = 5


@dataclass(frozen=True, slots=True)
class LogRecord:
    op: LogOp
    key: str
    seq: int
    segment: int  # a segment code, or a generation for ROTATE
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key_len: int
    length: int
    seq: int
    payload_hash: int
    gap: int = 0  # zero bytes between the key and the payload
    page_digest: bool = False  # payload_hash is the page's own (PAGE_DIGEST)


def align8(n: int) -> int:
    return (n + 7) & ~7


def record_bytes(key_len: int, length: int, gap: int = 0) -> int:
    """Bytes a record takes in its segment, its gap and padding included."""
    return align8(RECORD_HEADER + key_len + gap + length)


def payload_gap(offset: int, key_len: int, length: int, last_piece: int) -> int:
    """The gap for a record at ``offset`` whose payload ends with a piece of ``last_piece``
    bytes: 0 up to ``LARGE_RECORD_BYTES``, else what puts that piece on a 64-byte boundary."""
    if length <= LARGE_RECORD_BYTES:
        return 0
    return -(offset + RECORD_HEADER + key_len + length - last_piece) % _ALIGN


def segment_code(slot: int, number: int) -> int:
    """One int naming a segment: its writer slot and its number within that slot."""
    return (slot << 32) | number


def split_code(code: int) -> tuple[int, int]:
    return code >> 32, code & 0xFFFFFFFF


# ----- segments -------------------------------------------------------------------------------
def segment_header(slot: int, number: int, created_ns: int) -> bytes:
    body = _SEG.pack(_SEG_MAGIC, FORMAT_VERSION, slot, number, created_ns)
    crc = struct.pack("<I", zlib.crc32(body))
    return (body + crc).ljust(SEGMENT_HEADER, b"\0")


def parse_segment_header(data: bytes) -> tuple[int, int, int] | None:
    """``(slot, number, created_ns)``, or None for bytes that are no segment header of ours."""
    if len(data) < SEGMENT_HEADER:
        return None
    body = data[: _SEG.size]
    (crc,) = struct.unpack_from("<I", data, _SEG.size)
    magic, version, slot, number, created = _SEG.unpack(body)
    if magic != _SEG_MAGIC or version != FORMAT_VERSION or zlib.crc32(body) != crc:
        return None
    return slot, number, created


def payload_hash(segs: list[memoryview]) -> int:
    if len(segs) == 1:
        return xxhash.xxh3_64_intdigest(segs[0])
    h = xxhash.xxh3_64()
    for s in segs:
        h.update(s)
    return h.intdigest()


_pack_rec, _pack_rec_crc, _crc32 = _REC.pack, _REC_CRC.pack, zlib.crc32  # bound once: hot


def pack_record_header(key: bytes, length: int, seq: int, digest: int, flags: int = 0) -> bytes:
    """The 40-byte header of a record whose key, a gap of ``flags & 63`` zero bytes and payload
    follow it (``flags`` may add :data:`PAGE_DIGEST`)."""
    body = _pack_rec(_REC_MAGIC, len(key), flags, length, seq, digest)
    return body + _pack_rec_crc(_crc32(key, _crc32(body)))


def parse_record_header(data: memoryview | bytes, key: bytes | None = None) -> RecordHeader | None:
    """The header at the start of ``data`` (header then key), or None when it is damaged.

    ``data`` must hold the header and the key; with ``key`` given, the stored key must be it.
    """
    if len(data) < RECORD_HEADER:
        return None
    magic, key_len, flags, length, seq, digest = _REC.unpack_from(data)
    if magic != _REC_MAGIC or flags & ~_FLAG_BITS or len(data) < RECORD_HEADER + key_len:
        return None
    stored_key = bytes(data[RECORD_HEADER : RECORD_HEADER + key_len])
    if key is not None and stored_key != key:
        return None
    (crc,) = _REC_CRC.unpack_from(data, _REC.size)
    if zlib.crc32(stored_key, zlib.crc32(bytes(data[: _REC.size]))) != crc:
        return None
    return RecordHeader(key_len, length, seq, digest, flags & _GAP_BITS, bool(flags & PAGE_DIGEST))


def record_digest(segs: list[memoryview], length: int) -> tuple[int, int]:
    """``(xxh3, flags)`` a record of payload ``segs`` (``length`` bytes) is stored with: the
    page's own checksum and :data:`PAGE_DIGEST` when the first segment is a page header for
    ``length`` bytes (no pass over the payload), else the payload's xxh3 and no flag."""
    if length > LARGE_RECORD_BYTES and segs[0].nbytes >= HEADER_SIZE:
        checksum = stored_payload_checksum(segs[0], length)
        if checksum is not None:
            return checksum, PAGE_DIGEST
    return payload_hash(segs), 0


def payload_intact(payload: memoryview, digest: int, page_digest: bool) -> bool:
    """Whether a whole payload read back checks out against its record header's xxh3 and, for
    a large record holding a page, against the page's own checksum (see reads.py)."""
    page_sum = (
        stored_payload_checksum(payload, payload.nbytes)
        if payload.nbytes > LARGE_RECORD_BYTES
        else None
    )
    if page_digest:
        if page_sum != digest:
            return False
    elif xxhash.xxh3_64_intdigest(payload) != digest:
        return False
    return page_sum is None or xxhash.xxh3_64_intdigest(payload[HEADER_SIZE:]) == page_sum


# ----- index logs -----------------------------------------------------------------------------
def log_header(slot: int, generation: int) -> bytes:
    body = _LOG.pack(_LOG_MAGIC, FORMAT_VERSION, slot, generation)
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(LOG_HEADER, b"\0")


def parse_log_header(data: bytes) -> tuple[int, int] | None:
    """``(slot, generation)`` of a log's first bytes, or None when they are not a log header."""
    if len(data) < LOG_HEADER:
        return None
    magic, version, slot, generation = _LOG.unpack_from(data)
    (crc,) = struct.unpack_from("<I", data, _LOG.size)
    if magic != _LOG_MAGIC or version != FORMAT_VERSION or zlib.crc32(data[: _LOG.size]) != crc:
        return None
    return slot, generation


def encode_log_frame(records: list[tuple[LogOp, str, int, int, int, int]]) -> bytes:
    """One log frame: ``(op, key, seq, segment, offset, length)`` records under one CRC.

    A frame is what one call appends (a put batch's records), so it is whole or torn as one:
    a torn frame was never acknowledged to anyone.
    """
    pack = LOG_RECORD.pack
    parts = []
    for op, key, seq, segment, offset, length in records:
        kb = key.encode("ascii")
        parts.append(pack(op, len(kb), seq, segment, offset, length))
        parts.append(kb)
    return log_frame(b"".join(parts), len(records))


def log_frame(body: bytes, count: int) -> bytes:
    """A frame of ``count`` records whose packed bytes (``LOG_RECORD`` then the key, each)
    are ``body``."""
    return _FRAME.pack(zlib.crc32(body), len(body), count) + body


def encode_log_record(
    op: LogOp, key: str, seq: int, segment: int, offset: int, length: int
) -> bytes:
    """A frame of one record."""
    return encode_log_frame([(op, key, seq, segment, offset, length)])


def decode_log(data: bytes | memoryview, start: int = 0) -> tuple[list[LogRecord], int]:
    """The records of the whole frames of ``data`` from ``start``, and the offset just past
    the last one.

    Stops at the first frame that is incomplete or fails its CRC: a torn tail, or the place a
    writer is appending to right now.
    """
    out: list[LogRecord] = []
    pos, end = start, len(data)
    while pos + _FRAME.size <= end:
        crc, n, count = _FRAME.unpack_from(data, pos)
        body_at = pos + _FRAME.size
        if body_at + n > end:
            break
        body = data[body_at : body_at + n]
        if zlib.crc32(body) != crc:
            break
        records = _decode_frame(body, count)
        if records is None:
            break
        out.extend(records)
        pos = body_at + n
    return out, pos


def _decode_frame(body: bytes | memoryview, count: int) -> list[LogRecord] | None:
    """A frame body's ``count`` records, or None when they do not fill it exactly."""
    out = []
    pos, end, size = 0, len(body), LOG_RECORD.size
    for _ in range(count):
        if pos + size > end:
            return None
        op, key_len, seq, segment, offset, length = LOG_RECORD.unpack_from(body, pos)
        pos += size
        if op not in _OPS or pos + key_len > end:
            return None
        key = bytes(body[pos : pos + key_len]).decode("ascii", "replace")
        pos += key_len
        out.append(LogRecord(_OPS[op], key, seq, segment, offset, length))
    return out if pos == end else None


_OPS = {int(op): op for op in LogOp}


# ----- snapshots ------------------------------------------------------------------------------
@dataclass(slots=True)
class Snapshot:
    """The index at a point of each log: ``logs`` maps a slot to (generation, offset)."""

    logs: dict[int, tuple[int, int]]
    keys: list[str]
    segments: array[int]
    offsets: array[int]
    lengths: array[int]
    seqs: array[int]


def encode_snapshot(snap: Snapshot) -> Iterator[bytes]:
    """The snapshot as chunks to write one after the other (its header first)."""
    blob = "\n".join(snap.keys).encode("ascii")
    logs = b"".join(_SNAP_LOG.pack(s, g, o) for s, (g, o) in sorted(snap.logs.items()))
    arrays = [_le_bytes(a) for a in (snap.segments, snap.offsets, snap.lengths, snap.seqs)]
    h = xxhash.xxh3_64()
    for part in (logs, blob, *arrays):
        h.update(part)
    head = _SNAP.pack(
        _SNAP_MAGIC, FORMAT_VERSION, len(snap.logs), len(snap.keys), len(blob), h.intdigest()
    )
    yield head
    yield logs
    yield blob
    yield from arrays


def decode_snapshot(data: bytes) -> Snapshot | None:
    """The snapshot in ``data``, or None when it is damaged, truncated or not one."""
    if len(data) < _SNAP.size:
        return None
    magic, version, n_logs, n, blob_len, digest = _SNAP.unpack_from(data)
    logs_len = n_logs * _SNAP_LOG.size
    if magic != _SNAP_MAGIC or version != FORMAT_VERSION:
        return None
    if len(data) != _SNAP.size + logs_len + blob_len + 32 * n:
        return None
    body = memoryview(data)[_SNAP.size :]
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    logs = {}
    for i in range(n_logs):
        slot, gen, off = _SNAP_LOG.unpack_from(body, i * _SNAP_LOG.size)
        logs[slot] = (gen, off)
    pos = logs_len
    keys = bytes(body[pos : pos + blob_len]).decode("ascii").split("\n") if n else []
    pos += blob_len
    cols = []
    for _ in range(4):
        col = array("q")
        col.frombytes(body[pos : pos + 8 * n])
        cols.append(_from_le(col))
        pos += 8 * n
    if len(keys) != n:
        return None
    return Snapshot(logs, keys, *cols)


def _le_bytes(col: array[int]) -> bytes:
    if struct.pack("=q", 1) == struct.pack("<q", 1):
        return col.tobytes()
    swapped = array("q", col)
    swapped.byteswap()
    return swapped.tobytes()


def _from_le(col: array[int]) -> array[int]:
    if struct.pack("=q", 1) != struct.pack("<q", 1):
        col.byteswap()
    return col
