"""The ``disk`` backend's writing side: appends, deletes, snapshots (one slot, one process).

A put batch becomes records appended to this slot's open segment with one ``pwritev`` of the
record headers, keys and the callers' own buffers (no joined copy), then one append of their
PUT records to the slot's log, then the index. The data is written before the log names it,
so whatever a crash leaves, an indexed record is whole; with ``fsync`` both are synced before
the put returns. Everything here runs in worker threads, under one lock per process: appends
of a slot are sequential by nature, and the lock also orders them against reclaims.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from xxhash import xxh3_64_intdigest

from hicache.backends.disk.catalog import Catalog, snapshot_lock, snapshot_positions, write_snapshot
from hicache.backends.disk.config import DiskConfig
from hicache.backends.disk.direct import DirectTail, open_direct
from hicache.backends.disk.format import (
    LARGE_RECORD_BYTES,
    LOG_HEADER,
    LOG_RECORD,
    MAX_GAP,
    RECORD_HEADER,
    SEGMENT_HEADER,
    LogOp,
    encode_log_record,
    log_frame,
    pack_record_header,
    payload_gap,
    payload_hash,
    record_bytes,
    record_digest,
    segment_code,
    split_code,
)
from hicache.backends.disk.logs import LogWriter
from hicache.backends.disk.segments import create_segment, next_number, segment_name
from hicache.backends.segments import segments_after, segments_nbytes, split_iov
from hicache.keys import KEY_MAX_LEN

__all__ = ["Appender"]

logger = logging.getLogger(__name__)

_ZEROS = bytes(64)  # a record's gap and padding


@dataclass(slots=True)
class _Run:
    """Records of a batch bound for one stretch of one segment: the iovecs to write at
    ``start``, their log records and their index entries; ``first`` is the batch position
    of its first record."""

    start: int
    first: int
    iov: list[memoryview | bytes] = field(default_factory=list)
    log: list[bytes] = field(default_factory=list)
    entries: list[tuple[str, int, int, int, int]] = field(default_factory=list)


class Appender:
    """Appends of the slot this process holds (its lock file ``lock_fd`` kept locked)."""

    def __init__(self, catalog: Catalog, config: DiskConfig, slot: int, lock_fd: int) -> None:
        self.catalog = catalog
        self.config = config
        self.slot = slot
        self.lock_fd = lock_fd
        self.segment_bytes = catalog.dirs.segment_bytes
        # Any key's record fits in a segment; and half the capacity, so a put never has to
        # reclaim everything else to fit.
        largest = self.segment_bytes - SEGMENT_HEADER - record_bytes(KEY_MAX_LEN, 0, MAX_GAP)
        self.max_object_bytes = min(largest, (config.capacity or largest * 2) // 2)
        self.log = LogWriter(catalog.dirs.index, slot, config.fsync)
        self.log.recover(catalog.own_generation)
        self._seg_code = -1
        self._seg_fd = -1
        self._seg_end = 0
        self.counts = dict.fromkeys(
            ("put_errors", "enospc", "put_too_large", "snapshots", "bytes_staged",
             "direct_fallbacks"), 0
        )  # fmt: skip
        self._direct_fd = -1  # the open segment's O_DIRECT descriptor (direct=true)
        self._tail: DirectTail | None = None
        self.room: Callable[[int], bool] = lambda nbytes: True  # set by the reclaimer

    @property
    def current_segment(self) -> int:
        return self._seg_code

    # ----- puts -----------------------------------------------------------------------------
    def put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        """Append the batch; True where the object is stored and indexed. Call under the
        catalog's append lock."""
        sizes = [segments_nbytes(segs) for segs in values]
        fits = [n <= self.max_object_bytes for n in sizes]
        todo: Sequence[int]
        if all(fits):  # the usual case: no copies of the batch's lists
            todo, keys_in, values_in, sizes_in = range(len(keys)), keys, values, sizes
        else:
            self.counts["put_too_large"] += fits.count(False)
            todo = [i for i, ok in enumerate(fits) if ok]
            keys_in, values_in = [keys[i] for i in todo], [values[i] for i in todo]
            sizes_in = [sizes[i] for i in todo]
        results = [False] * len(keys)
        try:
            room = sum(record_bytes(len(k), n, MAX_GAP) for k, n in zip(keys_in, sizes_in))
            if not todo or not self.room(room):
                return results
            stored = self.append(keys_in, values_in, sizes_in)
            for i, ok in zip(todo, stored, strict=True):
                results[i] = ok
        except OSError as exc:
            # The log append (or a reclaim's) failed, a full disk most often: nothing of the
            # batch is indexed, so the put is False and counted, never an exception.
            self._count_error(exc, "a put failed")
            return results
        try:
            self.maybe_snapshot()
        except OSError as exc:  # the batch is stored and logged: the snapshot is retried later
            logger.warning("disk store %s: no snapshot: %s", self.catalog.dirs.root, exc)
        return results

    def append(
        self, keys: list[str], values: list[list[memoryview]], lengths: list[int] | None = None
    ) -> list[bool]:
        """Write, log and index records (no room check: the caller made room).

        The loop below is the per-object cost of a put, so it is kept to plain local work: one
        header pack, one xxh3, list appends; the system calls are one per run and one per log.
        """
        if lengths is None:
            lengths = [sum(s.nbytes for s in segs) for segs in values]
        return self._append(keys, values, lengths, None)

    def move(self, keys: list[str], payloads: list[memoryview], seqs: list[int]) -> list[bool]:
        """Append live records anew under the sequences they were written with (a reclaim's
        reinsertion, a compaction): logged as MOVE, so a DELETE or a newer PUT that another
        process made meanwhile still wins over the copy (see ``LogOp.MOVE``)."""
        values = [[p] for p in payloads]
        return self._append(keys, values, [p.nbytes for p in payloads], seqs)

    def _append(
        self,
        keys: list[str],
        values: list[list[memoryview]],
        lengths: list[int],
        moved_seqs: list[int] | None,
    ) -> list[bool]:
        """Records for ``keys`` in runs (one a segment), each run's log records and index
        entries built beside its iovecs and kept only if its write succeeded."""
        op = LogOp.PUT if moved_seqs is None else LogOp.MOVE
        pack_log, header = LOG_RECORD.pack, pack_record_header
        results = [False] * len(keys)
        done = _Run(0, 0)  # the log records and index entries of the runs written
        seq = self._reserve_seqs(len(keys)) if moved_seqs is None else 0
        end, limit, code = self._seg_end, self.segment_bytes, self._seg_code
        run = _Run(end, 0)
        iov, log, entries = run.iov, run.log, run.entries  # locals: this loop is the hot path
        for i, key in enumerate(keys):
            kb = key.encode("ascii")
            length, segs = lengths[i], values[i]
            large = length > LARGE_RECORD_BYTES  # its last piece aligned (format.payload_gap)
            gap = payload_gap(end, len(kb), length, segs[-1].nbytes) if large else 0
            size = (RECORD_HEADER + len(kb) + gap + length + 7) & ~7
            if self._seg_fd < 0 or end + size > limit:
                self._flush(run, end, i, done, results)
                if not self._new_segment():
                    break
                end, code = self._seg_end, self._seg_code
                gap = payload_gap(end, len(kb), length, segs[-1].nbytes) if large else 0
                size = (RECORD_HEADER + len(kb) + gap + length + 7) & ~7
                run = _Run(end, i)
                iov, log, entries = run.iov, run.log, run.entries
            if moved_seqs is not None:
                seq = moved_seqs[i]
            if large:  # a page's own checksum where it is one (format.record_digest)
                digest, flag = record_digest(segs, length)
            else:
                digest = xxh3_64_intdigest(segs[0]) if len(segs) == 1 else payload_hash(segs)
                flag = 0
            iov.append(header(kb, length, seq, digest, gap | flag))
            iov.append(kb)
            if gap:
                iov.append(_ZEROS[:gap])
            iov += segs
            pad = size - RECORD_HEADER - len(kb) - gap - length
            if pad:
                iov.append(_ZEROS[:pad])
            log.append(pack_log(op, len(kb), seq, code, end, length))
            log.append(kb)
            entries.append((key, code, end, length, seq))
            end += size
            seq += 1
        else:
            self._flush(run, end, len(keys), done, results)
        if done.entries:
            frame = log_frame(b"".join(done.log), len(done.entries))
            self._index(frame, done.entries, moved_seqs is not None)
        return results

    def _flush(self, run: _Run, end: int, upto: int, done: _Run, results: list[bool]) -> None:
        """Write ``run`` (batch items ``run.first`` to ``upto``, ending at ``end``); on success
        its log records and entries go to ``done`` and its items' results are True."""
        self._seg_end = end
        if run.iov and self._write(run.iov, run.start, end - run.start):
            done.log += run.log
            done.entries += run.entries
            results[run.first : upto] = [True] * (upto - run.first)

    def _index(
        self, frame: bytes, entries: list[tuple[str, int, int, int, int]], moved: bool
    ) -> None:
        """Log the written records (one frame), then index them."""
        self._log(frame, len(entries))
        index = self.catalog.index
        with self.catalog.lock:
            if not moved:
                index.put_many(entries)
            else:
                for entry in entries:
                    index.put(*entry, moved=True)

    def _write(self, iov: list[memoryview | bytes], offset: int, nbytes: int) -> bool:
        """One run of ``nbytes`` of records at ``offset`` of the open segment; False (counted)
        on failure, after which the segment is left for a new one."""
        try:
            if self._direct_fd >= 0:
                assert self._tail is not None
                self.counts["bytes_staged"] += self._tail.write(
                    self._direct_fd, iov, offset, nbytes
                )
                if self.config.fsync:
                    os.fdatasync(self._direct_fd)
                return True
            # One thread per segment: 64 pages of 8 MiB into one file, in the same memory state
            # each time, went at 4.2 GB/s from one thread and 2.9 from two writing halves of it
            # (they take turns on the file's lock); two threads each writing a file of its own
            # went at 7.2 (docs/BENCHMARKS.md, issue 48).
            for part, at, want in split_iov(iov, offset, 1):  # more than IOV_MAX pieces: cut
                self._pwrite_all(part, at, want)
            if self.config.fsync:
                os.fdatasync(self._seg_fd)
            return True
        except OSError as exc:
            self._count_error(exc, "a write failed")
            self._seal()
            return False

    def _pwrite_all(self, iov: list[memoryview | bytes], offset: int, want: int) -> None:
        """``iov`` at ``offset``, whole."""
        done = os.pwritev(self._seg_fd, iov, offset)
        while done < want:  # rare (a signal, a filesystem's limit): go on from where it stopped
            rest = segments_after([memoryview(p) for p in iov], done)
            n = os.pwritev(self._seg_fd, rest, offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "segment write made no progress")
            done += n

    def _count_error(self, exc: OSError, what: str) -> None:
        self.counts["put_errors"] += 1
        self.counts["enospc"] += exc.errno in (errno.ENOSPC, errno.EDQUOT)
        logger.warning("disk store %s: %s: %s", self.catalog.dirs.root, what, exc)

    def _new_segment(self) -> bool:
        self._seal()
        try:
            number = next_number(self.lock_fd)
            fd = create_segment(
                self.catalog.dirs.segments, self.slot, number, time.time_ns(), self.segment_bytes
            )
        except OSError as exc:
            self._count_error(exc, "cannot start a segment")
            return False
        self._seg_code, self._seg_fd, self._seg_end = (
            segment_code(self.slot, number),
            fd,
            SEGMENT_HEADER,
        )
        if self.config.direct:
            self._open_direct(number)
        return True

    def _open_direct(self, number: int) -> None:
        """The new segment's O_DIRECT descriptor, and the copy of its first block; buffered
        writes (counted, warned once) where the filesystem has no direct I/O."""
        code = self._seg_code
        fd = open_direct(segment_name(code), self.catalog.dirs.segments, os.O_WRONLY)
        if fd is None:
            if not self.counts["direct_fallbacks"]:
                logger.warning("disk store %s: no O_DIRECT on this filesystem; writes buffered",
                               self.catalog.dirs.root)  # fmt: skip
            self.counts["direct_fallbacks"] += 1
            return
        self._direct_fd = fd
        self._tail = DirectTail(os.pread(self._seg_fd, SEGMENT_HEADER, 0))

    def _seal(self) -> None:
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
        self._direct_fd, self._tail = -1, None
        if self._seg_fd >= 0:
            os.close(self._seg_fd)
        self._seg_fd, self._seg_code = -1, -1

    def _reserve_seqs(self, n: int) -> int:
        """The first of ``n`` consecutive sequences, newer than any this process has seen."""
        index = self.catalog.index
        first = max(index.clock + 1, time.time_ns())
        index.clock = first + n - 1
        return first

    def _log(self, data: bytes, records: int) -> None:
        self.log.append(data)
        self.log.records_since_rotate += records

    # ----- deletes and reclaims ---------------------------------------------------------------
    def delete(self, keys: list[str]) -> list[bool]:
        with self.catalog.lock:
            entries = [self.catalog.index.get(k) for k in keys]
        found = [e is not None for e in entries]
        gone = [k for k, f in zip(keys, found, strict=True) if f]
        if gone:
            seqs = [self._reserve_seqs(1) for _ in gone]
            records = zip(gone, seqs, strict=True)
            self._log(b"".join(encode_log_record(LogOp.DELETE, k, s, 0, 0, 0) for k, s in records),
                      len(gone))  # fmt: skip
            with self.catalog.lock:
                for key, seq in zip(gone, seqs, strict=True):
                    self.catalog.index.remove(key, seq)
            self.drop_empty({e[0] for e in entries if e is not None})
        return found

    def drop_empty(self, codes: set[int]) -> None:
        """Unlink this slot's sealed segments among ``codes`` that hold no live record any
        more: a deleted namespace frees its disk at once, not at the next reclaim."""
        live = self.catalog.index.live_bytes
        for code in codes:
            if code in live or code == self._seg_code or split_code(code)[0] != self.slot:
                continue
            self.log_reclaim(code)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_name(code), dir_fd=self.catalog.dirs.segments)

    def log_reclaim(self, code: int) -> None:
        self._log(encode_log_record(LogOp.RECLAIM, "", self._reserve_seqs(1), code, 0, 0), 1)
        with self.catalog.lock:
            self.catalog.index.drop_segment(code)
        self.catalog.files.forget(code)

    # ----- snapshots --------------------------------------------------------------------------
    def maybe_snapshot(self, force: bool = False) -> bool:
        due = self.log.records_since_rotate >= self.config.snapshot_records
        if not (due or (force and self.log.records_since_rotate)):
            return False
        return self.snapshot()

    def snapshot(self) -> bool:
        """Write the merged index as the store's snapshot and start a new log generation;
        False when another process is writing one, or has one further along some log."""
        catalog = self.catalog
        with snapshot_lock(catalog.dirs.index) as locked:
            if not locked:
                return False
            catalog.refresh()
            theirs = snapshot_positions(catalog) or {}
            generation = self.log.rotate()
            with catalog.lock:
                mine = catalog.positions()
                mine[self.slot] = (generation, LOG_HEADER)
                if any(mine.get(s, (0, 0)) < pos for s, pos in theirs.items() if s != self.slot):
                    return False
                snap = catalog.index.capture(mine)
            write_snapshot(catalog, snap, self.config.fsync)
            self.log.remove_before(generation)
            self.counts["snapshots"] += 1
            return True

    def seal(self) -> None:
        """Close the open segment, and unlink it if nothing in it is live (a deleted scratch
        namespace leaves no file behind)."""
        code = self._seg_code
        self._seal()
        self.drop_empty({code})

    def close(self) -> None:
        self._seal()
        self.log.close()
        os.close(self.lock_fd)
