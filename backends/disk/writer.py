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
from collections.abc import Callable

from hicache.backends.disk.catalog import Catalog, snapshot_lock, snapshot_positions, write_snapshot
from hicache.backends.disk.config import DiskConfig
from hicache.backends.disk.format import (
    LOG_HEADER,
    RECORD_HEADER,
    SEGMENT_HEADER,
    LogOp,
    encode_log_record,
    pack_record_header,
    payload_hash,
    record_bytes,
    segment_code,
    split_code,
)
from hicache.backends.disk.logs import LogWriter
from hicache.backends.disk.segments import create_segment, next_number, segment_name
from hicache.keys import KEY_MAX_LEN

__all__ = ["Appender"]

logger = logging.getLogger(__name__)

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_PAD = bytes(8)


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
        largest = self.segment_bytes - SEGMENT_HEADER - record_bytes(KEY_MAX_LEN, 0)
        self.max_object_bytes = min(largest, (config.capacity or largest * 2) // 2)
        self.log = LogWriter(catalog.dirs.index, slot, config.fsync)
        self.log.recover()
        self._seg_code = -1
        self._seg_fd = -1
        self._seg_end = 0
        self.counts = dict.fromkeys(("put_errors", "enospc", "put_too_large", "snapshots"), 0)
        self.room: Callable[[int], bool] = lambda nbytes: True  # set by the reclaimer

    @property
    def current_segment(self) -> int:
        return self._seg_code

    # ----- puts -----------------------------------------------------------------------------
    def put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        """Append the batch; True where the object is stored and indexed. Call under the
        catalog's append lock."""
        sizes = [sum(s.nbytes for s in segs) for segs in values]
        fits = [n <= self.max_object_bytes for n in sizes]
        self.counts["put_too_large"] += fits.count(False)
        todo = [i for i, ok in enumerate(fits) if ok]
        results = [False] * len(keys)
        try:
            if not todo or not self.room(sum(record_bytes(len(keys[i]), sizes[i]) for i in todo)):
                return results
            for i, ok in zip(todo, self.append([keys[i] for i in todo], [values[i] for i in todo]),
                             strict=True):  # fmt: skip
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

    def append(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        """Write, log and index records (no room check: reclaim's reinsertion calls this)."""
        results = [False] * len(keys)
        placed: list[tuple[int, str, int, int, int]] = []  # item, key, segment, offset, seq
        run: list[memoryview | bytes] = []
        run_items: list[tuple[int, str, int, int, int]] = []
        run_start = self._seg_end
        for i, (key, segs) in enumerate(zip(keys, values, strict=True)):
            kb = key.encode("ascii")
            length = sum(s.nbytes for s in segs)
            size = record_bytes(len(kb), length)
            if self._seg_fd < 0 or self._seg_end + size > self.segment_bytes:
                if run and self._write(run, run_start):
                    placed.extend(run_items)
                run, run_items = [], []
                if not self._new_segment():
                    return results
                run_start = self._seg_end
            seq = self._next_seq()
            run.append(pack_record_header(kb, length, seq, payload_hash(segs)))
            run.append(kb)
            run.extend(segs)
            pad = size - RECORD_HEADER - len(kb) - length
            if pad:
                run.append(_PAD[:pad])
            run_items.append((i, key, self._seg_code, self._seg_end, seq))
            self._seg_end += size
        if run and self._write(run, run_start):
            placed.extend(run_items)
        if not placed:
            return results
        lengths = {i: sum(s.nbytes for s in values[i]) for i, *_ in placed}
        self._log(
            b"".join(
                encode_log_record(LogOp.PUT, key, seq, code, off, lengths[i])
                for i, key, code, off, seq in placed
            ),
            len(placed),
        )
        with self.catalog.lock:
            index = self.catalog.index
            for i, key, code, off, seq in placed:
                index.put(key, code, off, lengths[i], seq)
                results[i] = True
        return results

    def _write(self, iov: list[memoryview | bytes], offset: int) -> bool:
        """One run of records at ``offset`` of the open segment; False (counted) on failure,
        after which the segment is left for a new one."""
        try:
            for start in range(0, len(iov), _IOV_MAX):
                part = iov[start : start + _IOV_MAX]
                want = sum(len(memoryview(p).cast("B")) for p in part)
                done = os.pwritev(self._seg_fd, part, offset)
                if done < want:  # rare: finish it through a joined copy
                    rest = b"".join(bytes(memoryview(p).cast("B")) for p in part)[done:]
                    while rest:
                        n = os.pwrite(self._seg_fd, rest, offset + done)
                        rest, done = rest[n:], done + n
                offset += want
            if self.config.fsync:
                os.fdatasync(self._seg_fd)
            return True
        except OSError as exc:
            self._count_error(exc, "a write failed")
            self._seal()
            return False

    def _count_error(self, exc: OSError, what: str) -> None:
        self.counts["put_errors"] += 1
        self.counts["enospc"] += exc.errno in (errno.ENOSPC, errno.EDQUOT)
        logger.warning("disk store %s: %s: %s", self.catalog.dirs.root, what, exc)

    def _new_segment(self) -> bool:
        self._seal()
        try:
            number = next_number(self.lock_fd)
            fd = create_segment(self.catalog.dirs.segments, self.slot, number, time.time_ns())
        except OSError as exc:
            self.counts["put_errors"] += 1
            self.counts["enospc"] += exc.errno in (errno.ENOSPC, errno.EDQUOT)
            logger.warning("disk store %s: cannot start a segment: %s", self.catalog.dirs.root, exc)
            return False
        self._seg_code, self._seg_fd, self._seg_end = (
            segment_code(self.slot, number),
            fd,
            SEGMENT_HEADER,
        )
        return True

    def _seal(self) -> None:
        if self._seg_fd >= 0:
            os.close(self._seg_fd)
        self._seg_fd, self._seg_code = -1, -1

    def _next_seq(self) -> int:
        index = self.catalog.index
        seq = max(index.clock + 1, time.time_ns())
        index.clock = seq
        return seq

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
            seqs = [self._next_seq() for _ in gone]
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
        self._log(encode_log_record(LogOp.RECLAIM, "", self._next_seq(), code, 0, 0), 1)
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
            theirs = snapshot_positions(catalog.dirs.index) or {}
            generation = self.log.rotate()
            with catalog.lock:
                mine = catalog.positions()
                mine[self.slot] = (generation, LOG_HEADER)
                if any(mine.get(s, (0, 0)) < pos for s, pos in theirs.items() if s != self.slot):
                    return False
                snap = catalog.index.capture(mine)
            write_snapshot(catalog.dirs.index, snap, self.config.fsync)
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
