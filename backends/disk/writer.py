"""The ``disk`` backend's writing side: appends, deletes, snapshots (one slot, one process).

A put batch becomes records appended to this slot's open segment with one ``pwritev`` of the
record headers, keys and the callers' own buffers (no joined copy; a batch of ``LANE_BYTES`` or
more: its two halves into two segments at once, see :mod:`.lanes`), then one append of their
PUT records to the slot's log, then the index. The data is written before the log names it,
so whatever a crash leaves, an indexed record is whole; with ``fsync`` both are synced before
the put returns. Everything here runs in worker threads, under one lock per process: appends
of a slot are sequential by nature, and the lock also orders them against reclaims.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xxhash import xxh3_64_intdigest

from hicache.backends.disk.catalog import Catalog, snapshot_lock, snapshot_positions, write_snapshot
from hicache.backends.disk.config import DiskConfig
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
    split_code,
)
from hicache.backends.disk.lanes import LaneShared, SegmentLane
from hicache.backends.disk.logs import LogWriter
from hicache.backends.disk.segments import segment_name
from hicache.backends.segments import segments_nbytes
from hicache.keys import KEY_MAX_LEN

__all__ = ["LANE_BYTES", "Appender"]

logger = logging.getLogger(__name__)

_ZEROS = bytes(64)  # a record's gap and padding
# Runs a function over groups of items on several threads, the results in item order
# (IOThreads.spread): how a large batch's two lanes are written at once.
Spread = Callable[[Callable[[list[Any]], list[Any]], list[Any]], list[Any]]
# A batch of at least this many bytes is written by two lanes (see lanes.py).
LANE_BYTES = 16 << 20
# Two lanes only where the capacity holds this many segments: each lane keeps one open, which
# no reclaim may take.
_LANE_ROOM_SEGMENTS = 8


@dataclass(frozen=True, slots=True)
class _Batch:
    """A batch being appended: its items, and the sequence of its first record (a move's
    records keep theirs, ``moved_seqs``)."""

    keys: list[str]
    values: list[list[memoryview]]
    lengths: list[int]
    moved_seqs: list[int] | None
    first_seq: int


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


def _lane_count(config: DiskConfig, segment_bytes: int, spread: Spread | None) -> int:
    """Two lanes where a second thread (``spread``) and the room for a second open segment
    are there, and writes are buffered."""
    roomy = config.capacity is None or config.capacity >= _LANE_ROOM_SEGMENTS * segment_bytes
    return 2 if spread is not None and not config.direct and roomy else 1


def _lane_cut(lengths: list[int]) -> int:
    """Where a batch is cut in two halves of about equal bytes; 0 (not cut) under
    ``LANE_BYTES``."""
    total = sum(lengths)
    if total < LANE_BYTES or len(lengths) < 2:
        return 0
    half, acc = total // 2, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= half:
            return min(i + 1, len(lengths) - 1)
    return 0


def _flush(lane: SegmentLane, run: _Run, end: int, done: list[_Run]) -> None:
    """Write ``run`` (ending at ``end``) into ``lane``; kept in ``done`` if written."""
    lane.end = end
    if run.iov and lane.write(run.iov, run.start, end - run.start):
        done.append(run)


class Appender:
    """Appends of the slot this process holds (its lock file ``lock_fd`` kept locked)."""

    def __init__(
        self,
        catalog: Catalog,
        config: DiskConfig,
        slot: int,
        lock_fd: int,
        spread: Spread | None = None,
    ) -> None:
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
        self.shared = LaneShared(catalog, config, slot, lock_fd)
        self.counts = self.shared.counts
        lanes = _lane_count(config, self.segment_bytes, spread)
        self.lanes = [SegmentLane(self.shared) for _ in range(lanes)]
        self._spread = spread
        self.room: Callable[[int], bool] = lambda nbytes: True  # set by the reclaimer

    @property
    def open_segments(self) -> set[int]:
        """The codes of the segments the lanes are appending to (never reclaimed)."""
        return {lane.code for lane in self.lanes if lane.is_open}

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
            self.shared.count_error(exc, "a put failed")
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
        """Records for ``keys``, a large batch cut in two by bytes and each half written into
        its lane's segment by a thread of its own (see :mod:`.lanes`); then one log frame for
        every record written, then the index."""
        first_seq = self._reserve_seqs(len(keys)) if moved_seqs is None else 0
        batch = _Batch(keys, values, lengths, moved_seqs, first_seq)
        cut = _lane_cut(lengths) if len(self.lanes) > 1 else 0
        if cut:
            parts = [(self.lanes[0], 0, cut), (self.lanes[1], cut, len(keys))]
            assert self._spread is not None
            done = self._spread(lambda group: [self._append_part(batch, *group[0])], parts)
        else:
            done = [self._append_part(batch, self.lanes[0], 0, len(keys))]
        results = [False] * len(keys)
        log: list[bytes] = []
        entries: list[tuple[str, int, int, int, int]] = []
        for part in done:
            for run in part:
                results[run.first : run.first + len(run.entries)] = [True] * len(run.entries)
                log += run.log
                entries += run.entries
        if entries:
            self._index(log_frame(b"".join(log), len(entries)), entries, moved_seqs is not None)
        return results

    def _append_part(self, batch: _Batch, lane: SegmentLane, lo: int, hi: int) -> list[_Run]:
        """Write items ``lo`` to ``hi`` of ``batch`` into ``lane``'s segments, in runs (one
        per segment); the runs written, each with its log records and index entries."""
        op = LogOp.PUT if batch.moved_seqs is None else LogOp.MOVE
        pack_log, header = LOG_RECORD.pack, pack_record_header
        keys, values, lengths = batch.keys, batch.values, batch.lengths
        moved_seqs = batch.moved_seqs
        done: list[_Run] = []
        seq = batch.first_seq + lo
        end, limit, code = lane.end, self.segment_bytes, lane.code
        run = _Run(end, lo)
        iov, log, entries = run.iov, run.log, run.entries  # locals: this loop is the hot path
        for i in range(lo, hi):
            kb = keys[i].encode("ascii")
            length, segs = lengths[i], values[i]
            large = length > LARGE_RECORD_BYTES  # its last piece aligned (format.payload_gap)
            gap = payload_gap(end, len(kb), length, segs[-1].nbytes) if large else 0
            size = (RECORD_HEADER + len(kb) + gap + length + 7) & ~7
            if not lane.is_open or end + size > limit:
                _flush(lane, run, end, done)
                if not lane.start_segment():
                    return done
                end, code = lane.end, lane.code
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
            entries.append((keys[i], code, end, length, seq))
            end += size
            seq += 1
        _flush(lane, run, end, done)
        return done

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
            if code in live or code in self.open_segments or split_code(code)[0] != self.slot:
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
        """Close the open segments, and unlink those with nothing live in them (a deleted
        scratch namespace leaves no file behind)."""
        codes = self.open_segments
        for lane in self.lanes:
            lane.seal()
        self.drop_empty(codes)

    def close(self) -> None:
        for lane in self.lanes:
            lane.seal()
        self.log.close()
        os.close(self.lock_fd)
