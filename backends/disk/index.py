"""The ``disk`` backend's in-memory index: key -> (segment, offset, length, sequence).

A dict maps each key to a row of four ``array('q')`` columns, so an entry costs a dict slot,
its key and 32 bytes, and a snapshot of a million entries loads as four array copies and one
dict build. Rows of deleted keys are reused.

Every change goes through :meth:`KeyIndex.apply` with the newest-sequence-wins rule, which makes
replaying several writers' logs order-independent: the same records in any order give the same
index. A MOVE (a record appended anew by a reclaim or a compaction) keeps its sequence and
replaces the entry of that sequence. A DELETE leaves a tombstone (key -> its sequence) in
memory, so an older PUT read after it (another slot's log, replayed later) does not bring the
key back. Tombstones are not part of snapshots: a put that raced a delete in another process
may come back after a reopen, with its own bytes, which is one of the two orders the race
allowed; and at most the last 1,048,576 are kept, so a long-lived process that deletes much
does not grow without bound.

Not thread-safe by itself: the backend holds its lock around every change.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

import numpy as np

from hicache.backends.disk.format import (
    RECORD_HEADER,
    LogOp,
    LogRecord,
    Snapshot,
    record_bytes,
)

__all__ = ["Entry", "KeyIndex"]

Entry = tuple[int, int, int, int]  # segment code, offset, length, sequence
_GROW_ROWS = 1024
_TOMBSTONES = 1 << 20  # the most deletes remembered (about 100 MB of keys at most)


class KeyIndex:
    def __init__(self) -> None:
        self._rows: dict[str, int] = {}
        self._seg = array("q")
        self._off = array("q")
        self._len = array("q")
        self._seq = array("q")
        self._free: list[int] = []
        # Per segment code: bytes its live records take (headers, keys and padding included,
        # so an empty object still counts and a segment with entries is never at zero).
        self.live_bytes: dict[int, int] = {}
        self.reclaimed: set[int] = set()  # segment codes that are gone
        # key -> sequence of a DELETE newer than any entry seen for it. Without these, replaying
        # slot 0's DELETE before slot 1's older PUT of the same key (logs are read slot by slot)
        # resurrected the deleted object. One per deleted key, dropped when a newer put lands.
        self._dead: dict[str, int] = {}
        self.clock = 0  # the largest sequence seen

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def get(self, key: str) -> Entry | None:
        row = self._rows.get(key)
        if row is None:
            return None
        return self._seg[row], self._off[row], self._len[row], self._seq[row]

    @property
    def used_bytes(self) -> int:
        return sum(self.live_bytes.values())

    # ----- changes ------------------------------------------------------------------------
    def apply(self, rec: LogRecord) -> None:
        """One log record, under the newest-sequence-wins rule."""
        if rec.seq > self.clock:
            self.clock = rec.seq
        if rec.op is LogOp.PUT or rec.op is LogOp.MOVE:
            if rec.segment not in self.reclaimed:
                moved = rec.op is LogOp.MOVE
                self.put(rec.key, rec.segment, rec.offset, rec.length, rec.seq, moved)
        elif rec.op is LogOp.DELETE:
            self.remove(rec.key, rec.seq)
        elif rec.op is LogOp.RECLAIM:
            self.drop_segment(rec.segment)

    def put(
        self, key: str, segment: int, offset: int, length: int, seq: int, moved: bool = False
    ) -> bool:
        """Point ``key`` at a record unless a newer one is indexed; whether it took. A
        ``moved`` record (a MOVE) also replaces the entry of its own sequence: the same
        object, now somewhere else."""
        dead = self._dead.get(key)
        if dead is not None:
            if dead >= seq:
                return False  # deleted after this put was made
            del self._dead[key]
        row = self._rows.get(key)
        if row is None:
            row = self._free.pop() if self._free else self._grow()
            self._rows[key] = row
        elif self._seq[row] > seq or (self._seq[row] == seq and not moved):
            return False
        else:
            self._unaccount(key, row)
        self._seg[row], self._off[row], self._len[row], self._seq[row] = (
            segment,
            offset,
            length,
            seq,
        )
        self.live_bytes[segment] = self.live_bytes.get(segment, 0) + record_bytes(len(key), length)
        return True

    def put_many(self, entries: list[tuple[str, int, int, int, int]]) -> None:
        """:meth:`put` of each ``(key, segment, offset, length, seq)``, which this process has
        just appended, so is newer than anything indexed: the hot path of a put batch."""
        rows, seg_c, off_c, len_c, seq_c = self._rows, self._seg, self._off, self._len, self._seq
        free, live, dead = self._free, self.live_bytes, self._dead
        for key, segment, offset, length, seq in entries:
            if dead:  # newer than any DELETE seen: its tombstone is of no more use
                dead.pop(key, None)
            row = rows.get(key)
            head = RECORD_HEADER + len(key) + 7
            if row is None:
                row = free.pop() if free else self._grow()
                rows[key] = row
            elif seq_c[row] >= seq:
                continue
            else:  # _unaccount, inline: an overwrite is the common case of a busy cache
                old = seg_c[row]
                left = live.get(old, 0) - ((head + len_c[row]) & ~7)
                if left > 0:
                    live[old] = left
                else:
                    live.pop(old, None)
            seg_c[row], off_c[row], len_c[row], seq_c[row] = segment, offset, length, seq
            live[segment] = live.get(segment, 0) + ((head + length) & ~7)

    def remove(self, key: str, seq: int | None = None) -> bool:
        """Forget ``key`` (only if its entry is not newer than ``seq``); whether it was there.

        With ``seq`` (a DELETE), puts of ``key`` not newer than ``seq`` are refused from now on,
        even those replayed after it."""
        row = self._rows.get(key)
        if row is not None and seq is not None and self._seq[row] > seq:
            return False
        if seq is not None and self._dead.get(key, -1) < seq:
            self._dead[key] = seq
            if len(self._dead) > _TOMBSTONES:
                # The oldest goes first: an older put of its key, still unread in another
                # slot's log after a million later deletes, would come back (its own bytes).
                del self._dead[next(iter(self._dead))]
        if row is None:
            return False
        del self._rows[key]
        self._unaccount(key, row)
        self._free.append(row)
        return True

    def remove_if_at(self, key: str, segment: int, offset: int) -> bool:
        """Forget ``key`` if its entry still points at ``segment``/``offset`` (a bad record)."""
        row = self._rows.get(key)
        if row is None or self._seg[row] != segment or self._off[row] != offset:
            return False
        return self.remove(key)

    def drop_segment(self, segment: int) -> list[str]:
        """Forget every entry in ``segment``; the keys dropped."""
        self.reclaimed.add(segment)
        if not self.live_bytes.pop(segment, 0):
            return []
        gone = [k for k, r in self._rows.items() if self._seg[r] == segment]
        for key in gone:
            row = self._rows.pop(key)
            self._free.append(row)
        return gone

    def load(self, snap: Snapshot) -> None:
        """Start from a snapshot (the index must be empty)."""
        n = len(snap.keys)
        self._seg, self._off, self._len, self._seq = (
            snap.segments,
            snap.offsets,
            snap.lengths,
            snap.seqs,
        )
        self._rows = dict(zip(snap.keys, range(n), strict=True))
        self._free = []
        if not n:
            return
        # Vectorised: a Python loop over a million entries would be most of the open time.
        segs = np.frombuffer(snap.segments, dtype=np.int64)
        key_lens = np.fromiter(map(len, snap.keys), dtype=np.int64, count=n)
        sizes = (RECORD_HEADER + key_lens + np.frombuffer(snap.lengths, np.int64) + 7) & ~7
        codes, where = np.unique(segs, return_inverse=True)
        totals = np.bincount(where, weights=sizes, minlength=len(codes))
        for code, total in zip(codes.tolist(), totals.tolist(), strict=True):
            self.live_bytes[code] = self.live_bytes.get(code, 0) + int(total)
        self.clock = max(self.clock, int(np.frombuffer(snap.seqs, np.int64).max()))

    def keep_segments(self, present: set[int]) -> int:
        """Drop entries whose segment file is gone; how many were dropped."""
        missing = [s for s in self.live_bytes if s not in present]
        return sum(len(self.drop_segment(s)) for s in missing)

    # ----- reading ------------------------------------------------------------------------
    def items(self, prefix: str = "") -> Iterator[tuple[str, Entry]]:
        """A copy's worth of entries whose key starts with ``prefix`` (taken at once)."""
        rows = [(k, r) for k, r in self._rows.items() if k.startswith(prefix)]
        for key, row in rows:
            yield key, (self._seg[row], self._off[row], self._len[row], self._seq[row])

    def in_segment(self, segment: int) -> Iterable[str]:
        return [k for k, r in self._rows.items() if self._seg[r] == segment]

    def capture(self, logs: dict[int, tuple[int, int]]) -> Snapshot:
        """The live entries, compacted, as a snapshot at the log points ``logs``."""
        keys = list(self._rows)
        rows = list(self._rows.values())
        cols = [array("q", map(col.__getitem__, rows)) for col in self._columns()]
        return Snapshot(dict(logs), keys, *cols)

    def _columns(self) -> tuple[array[int], ...]:
        return self._seg, self._off, self._len, self._seq

    def _grow(self) -> int:
        """A free row, the columns grown by a block of rows when none is left (one append
        per column per row would be a good part of a put's cost)."""
        start = len(self._seg)
        for col in self._columns():
            col.frombytes(bytes(8 * _GROW_ROWS))
        self._free.extend(range(start + _GROW_ROWS - 1, start, -1))
        return start

    def _unaccount(self, key: str, row: int) -> None:
        seg = self._seg[row]
        left = self.live_bytes.get(seg, 0) - record_bytes(len(key), self._len[row])
        if left > 0:
            self.live_bytes[seg] = left
        else:
            self.live_bytes.pop(seg, None)
