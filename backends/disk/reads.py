"""The ``disk`` backend's reads: records straight into the callers' buffers, checked.

Records that lie back to back in one segment (a prefix stored in one batch does) are read with
one ``preadv`` of at most ``PIECE_BYTES``: their headers and padding into a scratch buffer,
their payloads into the callers' segments. Each record is then checked against its index entry
(magic, key, length, write sequence) and its payload against the xxh3 in its header; one that
fails is a miss and is reported, so the index forgets it.

A record larger than ``PIECE_BYTES`` is read alone, in pieces of that size, each hashed right
after its read: the hash then reads bytes the CPU's cache still holds instead of a second pass
over memory, and (the hash holding the GIL, the read not) another thread's read of the batch
runs while this one hashes. Every byte is still checked before the read counts as a hit.

A first pass may run on the event loop with ``RWF_NOWAIT``: the kernel serves what its page
cache holds and refuses the rest instead of waiting for the disk, so a cached read costs no
thread hop and an uncached one never blocks the loop; the refused runs are read again,
blocking, in a worker thread.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Any

from xxhash import xxh3_64

from hicache.backends._io_threads import IOThreads
from hicache.backends.base import MISS, copy_into_segments
from hicache.backends.disk.direct import read_span
from hicache.backends.disk.format import (
    LARGE_RECORD_BYTES,
    MAX_GAP,
    PAGE_DIGEST,
    RECORD_HEADER,
    payload_hash,
    payload_intact,
    record_bytes,
)
from hicache.backends.disk.index import Entry
from hicache.backends.disk.segments import SegmentFiles
from hicache.backends.segments import IOV_MAX, segments_after, trim
from hicache.page_header import HEADER_SIZE as PAGE_HEADER
from hicache.page_header import stored_payload_checksum

__all__ = [
    "NOWAIT",
    "PARALLEL_BYTES",
    "PIECE_BYTES",
    "ReadItem",
    "read_records",
    "read_spread",
    "trim",
]

_REC = struct.Struct("<4sHHQQQ")  # format.py's record header, without its CRC
_MAGIC = b"HDSR"
_GAP_BITS = 0x3F  # format.py's: the flags hold the gap before a large record's payload
# RWF_NOWAIT where the platform has it (Linux 4.14+); 0 turns the first pass off.
NOWAIT = getattr(os, "RWF_NOWAIT", 0)
# The most one preadv reads before its records are hashed: it fits the CPU's cache, so the hash
# reads cached bytes, not a second pass over memory (docs/BENCHMARKS.md, issue 48). A record
# larger than this may have a gap before its payload (format.py), so it is read on its own,
# its header first.
PIECE_BYTES = LARGE_RECORD_BYTES
# A batch at least this large is read by several threads, each a stretch of it (writes to a
# segment take one thread each: lanes.py).
PARALLEL_BYTES = 8 << 20
# A large batch is cut into this many groups per thread, claimed one at a time, so a thread
# the scheduler holds back leaves its share to the others.
_GROUPS_PER_THREAD = 4

#: One read: key, index entry (segment code, offset, length, sequence), and exactly ``length``
#: bytes of the caller's buffer as views.
ReadItem = tuple[str, Entry, list[memoryview]]


def read_spread(
    files: SegmentFiles, items: list[ReadItem], io: IOThreads | None
) -> tuple[list[int], list[int]]:
    """:func:`read_records` (blocking), by several threads when the batch is large (see
    ``PARALLEL_BYTES``: page faults on a VM): each reads a stretch of the batch in
    segment order. Each item's length or MISS, and the positions of bad records."""
    if io is None or len(items) < 2 or sum(it[1][2] for it in items) < PARALLEL_BYTES:
        got, bad, _ = read_records(files, items)
        return got, bad
    order = sorted(range(len(items)), key=lambda i: (items[i][1][0], items[i][1][1]))
    step = -(-len(order) // (io.threads * _GROUPS_PER_THREAD))
    groups = [order[lo : lo + step] for lo in range(0, len(order), step)]

    def read_group(chunk: list[list[int]]) -> list[tuple[list[int], list[int], list[int]]]:
        return [read_records(files, [items[i] for i in g]) for g in chunk]

    results, bad = [MISS] * len(items), []
    for group, (got, bad_here, _) in zip(groups, io.spread(read_group, groups), strict=True):
        for i, n in zip(group, got, strict=True):
            results[i] = n
        bad.extend(group[j] for j in bad_here)
    return results, bad


def read_records(
    files: SegmentFiles, items: list[ReadItem], flags: int = 0
) -> tuple[list[int], list[int], list[int]]:
    """Each item's length or MISS; the positions of items whose record failed a check; and,
    with ``flags`` = :data:`NOWAIT`, the positions the kernel would have had to wait for."""
    results = [MISS] * len(items)
    bad: list[int] = []
    later: list[int] = []
    order = sorted(range(len(items)), key=lambda i: (items[i][1][0], items[i][1][1]))
    run: list[int] = []
    iov = nbytes = 0  # iovecs the run needs (a header, the payload's segments, maybe padding)
    next_at = (-1, -1)
    for i in order:
        code, off, length, _ = items[i][1]
        need = 2 + len(items[i][2])
        size = (RECORD_HEADER + len(items[i][0]) + length + 7) & ~7
        if run and ((code, off) != next_at or iov + need > IOV_MAX or nbytes + size > PIECE_BYTES):
            _read_run(files, items, run, results, bad, later, flags)
            run, iov, nbytes = [], 0, 0
        run.append(i)
        iov += need
        nbytes += size
        next_at = (code, off + size)
    if run:
        _read_run(files, items, run, results, bad, later, flags)
    return results, bad, later


def _read_run(
    files: SegmentFiles,
    items: list[ReadItem],
    run: list[int],
    results: list[int],
    bad: list[int],
    later: list[int],
    flags: int,
) -> None:
    code, start = items[run[0]][1][:2]
    fd = files.fd(code)
    if fd is None:
        return  # the segment is gone (reclaimed): misses
    direct = files.direct_fd(code)
    if direct is not None:
        _read_run_direct(files, direct, items, run, results, bad)
        return
    if len(run) == 1 and items[run[0]][1][2] > PIECE_BYTES:
        i = run[0]
        outcome = _read_in_pieces(fd, items[i], flags)
        if outcome == _HIT:
            results[i] = items[i][1][2]
        elif outcome == _BAD:
            bad.append(i)
        elif outcome == _LATER:
            later.append(i)
        return
    heads = []
    overhead = 0
    for i in run:
        key, (_, _, length, _), _ = items[i]
        head = RECORD_HEADER + len(key)
        pad = ((head + length + 7) & ~7) - head - length
        heads.append((overhead, head, pad))
        overhead += head + pad
    scratch = memoryview(bytearray(overhead))
    iov: list[memoryview] = []
    ends = []
    end = 0
    for i, (at, head, pad) in zip(run, heads, strict=True):
        iov.append(scratch[at : at + head])
        iov.extend(items[i][2])
        if pad:
            iov.append(scratch[at + head : at + head + pad])
        end += head + items[i][1][2] + pad
        ends.append(end)
    try:
        got = os.preadv(fd, iov, start, flags) if flags else os.preadv(fd, iov, start)
    except BlockingIOError:
        later.extend(run)
        return
    except OSError as exc:
        if flags and exc.errno == errno.EOPNOTSUPP:
            later.extend(run)  # no RWF_NOWAIT on this filesystem: read in the worker
        return  # a descriptor closed under us by a reclaim, an I/O error: misses
    for i, (at, _, _), rec_end in zip(run, heads, ends, strict=True):
        if rec_end > got:
            # With NOWAIT: cached only in part, the rest from the worker. Without: the
            # segment was cut short (by hand): damaged records, misses and forgotten (else
            # `exists` kept reporting them, and every read of them missed again).
            if flags:
                later.append(i)
            else:
                bad.append(i)
            continue
        key, (_, _, length, seq), target = items[i]
        digest = _header_digest(scratch, at, key.encode("ascii"), length, seq)
        if digest is not None and payload_hash(target) == digest:
            results[i] = length
        else:
            bad.append(i)


_HIT, _BAD, _LATER, _GONE = range(4)


def _read_in_pieces(fd: int, item: ReadItem, flags: int) -> int:
    """One large record: its header first (which names the gap before the payload), then the
    payload in pieces of ``PIECE_BYTES``, each hashed after its read (see the module
    docstring). ``_HIT``, ``_BAD`` (it failed a check, or the segment ends inside it),
    ``_LATER`` (with :data:`NOWAIT`: not all cached) or ``_GONE`` (an I/O error: a miss)."""
    key, (_, offset, length, seq), target = item
    kb = key.encode("ascii")
    head = memoryview(bytearray(RECORD_HEADER + len(kb)))
    failed = _fill(fd, [head], offset, flags)
    if failed is not None:
        return failed
    fields = _header_fields(head, 0, kb, length, seq)
    if fields is None:
        return _BAD
    digest, record_flags = fields
    at, done = offset + head.nbytes + (record_flags & _GAP_BITS), 0
    checks = _PieceChecks(digest, record_flags & PAGE_DIGEST)
    while done < length:
        n = min(PIECE_BYTES, length - done)
        piece = trim(segments_after(target, done), n)
        failed = _fill(fd, piece, at + done, flags)
        if failed is not None:
            return failed
        if done == 0 and not checks.start(piece, length):
            return _BAD
        checks.update(piece, PAGE_HEADER if done == 0 else 0)
        done += n
    return _HIT if checks.passed() else _BAD


class _PieceChecks:
    """The hashes a large record's payload is checked with, piece by piece as it is read:
    the record's xxh3 of the whole payload, and the page's own checksum of what follows the
    page header where the payload is a page. A ``PAGE_DIGEST`` record has only the latter (its
    record xxh3 is the page's). So every page read here had its page checksum checked, and
    ``get_into``'s callers need not hash it again (``Capabilities.checks_pages_over``)."""

    def __init__(self, digest: int, page_digest: int) -> None:
        self.digest = digest
        self.record = None if page_digest else xxh3_64()
        self.page: Any = None
        self.page_sum = -1

    def start(self, first: list[memoryview], length: int) -> bool:
        """Look at the first piece; False where a ``PAGE_DIGEST`` record holds no page header
        for its length, or one whose checksum is not the record's."""
        head = memoryview(b"".join(v.tobytes() for v in trim(first, PAGE_HEADER)))
        page_sum = stored_payload_checksum(head, length)
        if self.record is None and page_sum != self.digest:
            return False
        if page_sum is not None:
            self.page, self.page_sum = xxh3_64(), page_sum
        return True

    def update(self, piece: list[memoryview], skip: int) -> None:
        if self.record is not None:
            for view in piece:
                self.record.update(view)
        if self.page is not None:
            for view in segments_after(piece, skip) if skip else piece:
                self.page.update(view)

    def passed(self) -> bool:
        if self.record is not None and self.record.intdigest() != self.digest:
            return False
        return self.page is None or self.page.intdigest() == self.page_sum


def _fill(fd: int, iov: list[memoryview], at: int, flags: int) -> int | None:
    """``iov`` read whole from ``at``: None, else what the record's read comes to (see
    :func:`_read_in_pieces`)."""
    try:
        got = os.preadv(fd, iov, at, flags) if flags else os.preadv(fd, iov, at)
    except BlockingIOError:
        return _LATER
    except OSError as exc:
        return _LATER if flags and exc.errno == errno.EOPNOTSUPP else _GONE
    if got < sum(v.nbytes for v in iov):
        return _LATER if flags else _BAD
    return None


def _read_run_direct(
    files: SegmentFiles,
    fd: int,
    items: list[ReadItem],
    run: list[int],
    results: list[int],
    bad: list[int],
) -> None:
    """The run through whole blocks into staging (O_DIRECT), each record checked and copied
    out to its caller's buffer."""
    first = items[run[0]][1][1]
    last_key, last = items[run[-1]][0], items[run[-1]][1]
    end = last[1] + record_bytes(len(last_key), last[2], MAX_GAP)
    try:
        data, staged = read_span(fd, first, end)
    except OSError:
        return  # misses
    files.note_staged(staged)
    for i in run:
        key, (_, off, length, seq), target = items[i]
        at = off - first
        kb = key.encode("ascii")
        fields = (
            _header_fields(data, at, kb, length, seq) if at + RECORD_HEADER <= data.nbytes else None
        )
        body = at + RECORD_HEADER + len(kb) + (fields[1] & _GAP_BITS if fields is not None else 0)
        if fields is None or body + length > data.nbytes:
            bad.append(i)  # damaged, or past the end of the file: a segment cut short
            continue
        payload = data[body : body + length]
        if not payload_intact(payload, fields[0], bool(fields[1] & PAGE_DIGEST)):
            bad.append(i)
            continue
        copy_into_segments(payload, target)
        results[i] = length


def _header_digest(buf: memoryview, at: int, key: bytes, length: int, seq: int) -> int | None:
    """The payload xxh3 of the record header at ``at`` of ``buf`` (its key following it), when
    the header is the index entry's (magic, key, length, sequence) and the payload follows the
    key directly (a record read in a run: no gap); None otherwise."""
    fields = _header_fields(buf, at, key, length, seq)
    return fields[0] if fields is not None and fields[1] == 0 else None


def _header_fields(
    buf: memoryview, at: int, key: bytes, length: int, seq: int
) -> tuple[int, int] | None:
    """``(payload xxh3, flags)`` of the record header at ``at`` of ``buf`` (its key following
    it), when the header is the index entry's; None otherwise. The flags' low six bits are the
    gap before the payload; ``PAGE_DIGEST`` may be set (format.py)."""
    magic, key_len, flags, stored_len, stored_seq, digest = _REC.unpack_from(buf, at)
    ok = magic == _MAGIC and not flags & ~(_GAP_BITS | PAGE_DIGEST)
    if not ok or (key_len, stored_len, stored_seq) != (len(key), length, seq):
        return None
    if buf[at + RECORD_HEADER : at + RECORD_HEADER + key_len] != key:
        return None
    return int(digest), flags
