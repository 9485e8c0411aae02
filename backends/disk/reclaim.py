"""The ``disk`` backend's capacity: whole segments reclaimed, least recently used first.

When a put would take the store's segments past ``capacity``, sealed segments are reclaimed
until it fits: segments no entry points at first, then by last use (the newest of their last
read in this process and their last write). Objects of a victim read since they were written
(this process's reads, the last ``HOT_KEYS``) are appended anew first, as CacheLib's Navy
reinserts hit objects; a reinserted object must be read again to survive the next reclaim.

A process reclaims segments of its own slot and of slots no running process holds (it takes
their lock while it does); another live writer's segments are left to that writer. The size of
the store is the sum of its segment files, listed again whenever the running estimate says it
is full, so other writers' segments count.

Compaction (:meth:`Reclaimer.compact`) moves the live records out of segments that are mostly
dead (deleted or superseded) and reclaims them, for ``hicache compact``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from hicache.backends.disk.catalog import Catalog
from hicache.backends.disk.format import (
    MAX_GAP,
    RECORD_HEADER,
    parse_record_header,
    payload_intact,
    split_code,
)
from hicache.backends.disk.layout import try_lock_slot
from hicache.backends.disk.segments import Found, list_segments, segment_name
from hicache.backends.disk.writer import Appender

__all__ = ["HOT_KEYS", "Reclaimer"]


HOT_KEYS = 1 << 16
_REINSERT_SHARE = 0.5  # at most this share of a victim's bytes is appended anew


@dataclass(slots=True)
class _Segment:
    code: int
    size: int
    last_use_ns: int


class Reclaimer:
    def __init__(self, catalog: Catalog, appender: Appender, capacity: int | None, reinsert: bool):
        self.catalog = catalog
        self.appender = appender
        self.capacity = capacity
        self.reinsert = reinsert
        self.hot: OrderedDict[str, None] = OrderedDict()
        self.last_read_ns: dict[int, int] = {}
        self.counts = dict.fromkeys(("reclaimed_segments", "reinserted", "put_no_room"), 0)
        self._estimate = self._disk_bytes() if capacity is not None else 0
        appender.room = self.make_room

    def note_reads(self, keys: list[str], segments: list[int]) -> None:
        now = time.time_ns()
        hot = self.hot
        for key in keys:
            hot[key] = None
            hot.move_to_end(key)
        while len(hot) > HOT_KEYS:
            hot.popitem(last=False)
        for code in segments:
            self.last_read_ns[code] = now

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit without reclaiming anything (by the running estimate)."""
        return self.capacity is None or self._estimate + nbytes <= self.capacity

    def make_room(self, nbytes: int) -> bool:
        """Reclaim until ``nbytes`` more fit; False (counted) when they cannot."""
        if self.capacity is None:
            return True
        if self._estimate + nbytes <= self.capacity:
            self._estimate += nbytes
            return True
        self._estimate = self._disk_bytes()
        victims = self._candidates()
        while self._estimate + nbytes > self.capacity and victims:
            self._estimate -= self._reclaim(victims.pop(0))
        if self._estimate + nbytes > self.capacity:
            self.counts["put_no_room"] += 1
            return False
        self._estimate += nbytes
        return True

    def _disk_bytes(self) -> int:
        return sum(st.st_size for st in list_segments(self.catalog.dirs.segments).values())

    def _candidates(self) -> list[_Segment]:
        live = self.catalog.index.live_bytes
        out = []
        for code, st in list_segments(self.catalog.dirs.segments).items():
            if code in self.appender.open_segments:
                continue
            used = max(self.last_read_ns.get(code, 0), st.st_mtime_ns)
            out.append(_Segment(code, st.st_size, used if code in live else -1))
        out.sort(key=lambda s: s.last_use_ns)
        return out

    def _reclaim(self, seg: _Segment, move_all: bool = False) -> int:
        """Reclaim one segment if its slot allows, its live records moved first with
        ``move_all`` (else its hot ones); the bytes freed (0 when it was skipped)."""
        slot, _ = split_code(seg.code)
        lock = None
        if slot != self.appender.slot:
            lock = try_lock_slot(self.catalog.dirs.locks, slot)
            if lock is None:
                return 0  # its writer is running: its segments are its own
        try:
            if move_all:
                with self.catalog.lock:
                    keys = list(self.catalog.index.in_segment(seg.code))
                self._copy(seg.code, self._live(seg.code, keys))
            elif self.reinsert and seg.last_use_ns >= 0:
                self._reinsert(seg)
            self.appender.log_reclaim(seg.code)
            self.last_read_ns.pop(seg.code, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_name(seg.code), dir_fd=self.catalog.dirs.segments)
            self.counts["reclaimed_segments"] += 1
            return seg.size
        finally:
            if lock is not None:
                os.close(lock)

    def _live(self, code: int, keys: Iterable[str]) -> list[Found]:
        """The records of segment ``code`` the index points at, among ``keys``, in segment
        order (from the index: a walk of the segment would stop at a stretch damaged by
        hand, and the records after it would be dropped with the segment)."""
        index = self.catalog.index
        out = []
        with self.catalog.lock:
            for key in keys:
                entry = index.get(key)
                if entry is not None and entry[0] == code:
                    out.append(Found(entry[1], key, entry[2], entry[3], None))
        out.sort(key=lambda rec: rec.offset)
        return out

    def _reinsert(self, seg: _Segment) -> None:
        budget = int(seg.size * _REINSERT_SHARE)
        chosen = []
        for rec in self._live(seg.code, list(self.hot)):
            if budget >= rec.length:
                budget -= rec.length
                chosen.append(rec)
        moved = self._copy(seg.code, chosen)
        for rec in chosen:
            self.hot.pop(rec.key, None)
        self.counts["reinserted"] += moved

    def _copy(self, code: int, records: list[Found]) -> int:
        """Append ``records`` of segment ``code`` anew, a batch at a time, each checked as it
        is read (a damaged one is left to go with its segment); how many were appended."""
        fd = self.catalog.files.fd(code)
        if fd is None or not records:
            return 0
        batch: list[tuple[Found, memoryview]] = []
        moved = 0
        for rec in records:
            data = _read_checked(fd, rec)
            if data is not None:
                batch.append((rec, data))
            if batch and (len(batch) >= 64 or rec is records[-1]):
                keys, seqs = [r.key for r, _ in batch], [r.seq for r, _ in batch]
                moved += sum(self.appender.move(keys, [d for _, d in batch], seqs))
                batch = []
        return moved

    def compact(self, min_dead: float) -> tuple[int, int]:
        """Move live records out of sealed segments at least ``min_dead`` dead, and reclaim
        them; (segments reclaimed, bytes freed)."""
        live = self.catalog.index.live_bytes
        freed = count = 0
        for seg in self._candidates():
            if seg.size <= 0 or 1 - live.get(seg.code, 0) / seg.size < min_dead:
                continue
            done = self._reclaim(seg, move_all=True)
            freed += done
            count += done > 0
        return count, freed


def _read_checked(fd: int, rec: Found) -> memoryview | None:
    """The payload of ``rec`` if its record checks out (header, key, sequence, xxh3)."""
    kb = rec.key.encode("ascii")
    try:  # the most a gap can add read too (format.py): one read whatever the gap
        data = os.pread(fd, RECORD_HEADER + len(kb) + MAX_GAP + rec.length, rec.offset)
    except OSError:
        return None
    h = parse_record_header(data, kb)
    if h is None or h.length != rec.length or h.seq != rec.seq:
        return None
    body = RECORD_HEADER + len(kb) + h.gap
    payload = memoryview(data)[body : body + rec.length]
    if payload.nbytes != rec.length or not payload_intact(payload, h.payload_hash, h.page_digest):
        return None
    return payload
