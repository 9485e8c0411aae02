"""The ``3fs`` backend's bookkeeping: which key is in which slot, and which slots are free.

:class:`SlotTable` owns the in-memory index (least recently used first), the free list, reader
pins and the index log, all under one lock; it does no data I/O. Its rule: a slot becomes free
only after the record that made it dead is in the log and no reader holds it. Methods that
kill slots return them instead of freeing them, because the backend zeroes a slot's header
(data I/O) before handing it back through :meth:`SlotTable.free`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from hicache.backends.hf3fs.index import Entry, IndexLog, Replay, encode_delete, encode_put

__all__ = ["SlotTable"]

logger = logging.getLogger(__name__)

_COMPACT_MIN = 4096  # superseded records tolerated in the log before it is rewritten
COUNTERS = (
    "evictions",
    "put_too_large",
    "put_no_room",
    "put_errors",
    "read_errors",
    "slot_mismatches",
    "index_errors",
    "index_corrupt_records",
    "index_torn_bytes",
    "compactions",
    "bytes_staged",  # USRBIO: object bytes copied through a lane's shared-memory buffer
)


class SlotTable:
    """Index, free list and pins of one rank; every method is thread-safe."""

    def __init__(self, log: IndexLog) -> None:
        self.log = log
        self.slot_bytes = log.geometry.slot_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, Entry] = OrderedDict()
        self._free: list[int] = []
        self._pins: dict[int, int] = {}  # slot -> readers in flight
        self._zombies: set[int] = set()  # dead slots still being read: freed on last unpin
        self._seq = 0
        self.n = dict.fromkeys(COUNTERS, 0)
        self._warned: set[str] = set()

    def load(self) -> Replay:
        """Replay the log (see :meth:`IndexLog.load` for what it raises); every slot not named
        by a live record is free."""
        found = self.log.load()
        with self._lock:
            # Sequence numbers start from the clock, so they stay unique across restarts even
            # when a damaged log lost the highest ones.
            self._index, self._seq = found.entries, max(found.max_seq, time.time_ns())
            used = {entry.slot for entry in found.entries.values()}
            slots = self.log.geometry.slots
            self._free = [s for s in range(slots - 1, -1, -1) if s not in used]  # low first
            self.n["index_corrupt_records"] = found.corrupt
            self.n["index_torn_bytes"] = found.torn_bytes
        return found

    # ----- lookups ----------------------------------------------------------------------------
    def contains(self, keys: Sequence[str], timeout: float = -1) -> list[bool] | None:
        """Whether each key is stored; None if the lock was not had within ``timeout`` s."""
        if not self._lock.acquire(timeout=timeout):
            return None
        try:
            return [key in self._index for key in keys]
        finally:
            self._lock.release()

    def snapshot(self, prefix: str) -> list[tuple[str, int, float]]:
        with self._lock:
            return [(k, e.size, e.mtime) for k, e in self._index.items() if k.startswith(prefix)]

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self.n)
            out.update(objects=len(self._index), free_slots=len(self._free))
            out["index_records"] = self.log.records
        return out

    def count(self, counter: str, message: str) -> None:
        with self._lock:
            self.n[counter] += 1
        self.warn_once(counter, message)

    def add(self, counter: str, amount: int) -> None:
        """Add ``amount`` to a counter that is not an error (no warning)."""
        with self._lock:
            self.n[counter] += amount

    def warn_once(self, kind: str, message: str) -> None:
        # One warning per kind says it; the counters say how often. A race costs a duplicate.
        first = kind not in self._warned
        self._warned.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, "%s (%s)", message, self.log.path)

    # ----- writes -----------------------------------------------------------------------------
    def reserve(self, sizes: Sequence[int]) -> list[Entry | None]:
        """A fresh slot and sequence number per object; None where too large or no room."""
        out: list[Entry | None] = []
        evicted: list[str] = []
        now = time.time()
        with self._lock:
            for size in sizes:
                too_large = size > self.slot_bytes
                slot = None if too_large else self._take_slot_locked(evicted)
                if slot is None:
                    self.n["put_too_large" if too_large else "put_no_room"] += 1
                    out.append(None)
                    continue
                self._seq += 1
                out.append(Entry(slot, size, self._seq, now))
            if evicted:  # before their slots are rewritten; if it fails, slot headers protect
                self._append_locked(b"".join(encode_delete(k, self._seq) for k in evicted))
        return out

    def _take_slot_locked(self, evicted: list[str]) -> int | None:
        if self._free:
            return self._free.pop()
        # Full: the least recently used object that nobody is reading makes room.
        victim = next((k for k, e in self._index.items() if e.slot not in self._pins), None)
        if victim is None:
            return None  # every slot is being written or read
        self.n["evictions"] += 1
        evicted.append(victim)
        return self._index.pop(victim).slot

    def publish(self, done: Sequence[tuple[str, Entry]]) -> list[int] | None:
        """Log the records and point the index at the new slots; the slots this killed.

        None when the log could not be written: nothing changed, the reserved slots are the
        caller's to :meth:`free`.
        """
        dead: list[int] = []
        with self._lock:
            if not self._append_locked(b"".join(encode_put(k, e) for k, e in done)):
                return None
            for key, entry in done:
                old = self._index.pop(key, None)
                self._index[key] = entry
                if old is not None:
                    self._retire_locked(old.slot, dead)
            self._maybe_compact_locked()
        return dead

    def delete(self, keys: Sequence[str]) -> tuple[list[bool], list[int]]:
        """Remove keys (logged); whether each was there, and the slots this killed."""
        found: list[bool] = []
        dead: list[int] = []
        with self._lock:
            gone = []
            for key in keys:
                entry = self._index.pop(key, None)
                found.append(entry is not None)
                if entry is not None:
                    gone.append(key)
                    self._retire_locked(entry.slot, dead)
            if gone:  # a failed append leaves stale records; zeroed slots make them misses
                self._append_locked(b"".join(encode_delete(k, self._seq) for k in gone))
        return found, dead

    def forget(self, key: str, entry: Entry) -> None:
        """Drop a key whose slot does not hold its object (it never will again)."""
        with self._lock:
            if self._index.get(key) is entry:
                del self._index[key]
                self._append_locked(encode_delete(key, entry.seq))
                self._zombies.add(entry.slot)  # pinned by the reader that found it: freed on unpin

    def free(self, slots: Sequence[int]) -> None:
        """Make slots reusable: ones no record names (never published, or zeroed once dead)."""
        with self._lock:
            self._free.extend(slots)

    # ----- reads ------------------------------------------------------------------------------
    def pin(self, keys: Sequence[str], touch: bool) -> list[Entry | None]:
        """Each key's entry (None if absent), its slot held until :meth:`unpin`."""
        with self._lock:
            entries = [self._index.get(key) for key in keys]
            for key, entry in zip(keys, entries, strict=True):
                if entry is not None:
                    self._pins[entry.slot] = self._pins.get(entry.slot, 0) + 1
                    if touch:
                        self._index.move_to_end(key)
        return entries

    def unpin(self, entries: Sequence[Entry | None]) -> list[int]:
        """Let go of pinned slots; those that died meanwhile are returned to be released."""
        dead: list[int] = []
        with self._lock:
            for entry in entries:
                if entry is None:
                    continue
                left = self._pins[entry.slot] - 1
                if left:
                    self._pins[entry.slot] = left
                    continue
                del self._pins[entry.slot]
                if entry.slot in self._zombies:
                    self._zombies.discard(entry.slot)
                    dead.append(entry.slot)
        return dead

    # ----- internals (the caller holds the lock) ----------------------------------------------
    def _retire_locked(self, slot: int, dead: list[int]) -> None:
        if slot in self._pins:
            self._zombies.add(slot)
        else:
            dead.append(slot)

    def _append_locked(self, records: bytes) -> bool:
        try:
            self.log.append(records)
        except OSError as exc:
            self.n["index_errors"] += 1
            self.warn_once("index", f"index append failed: {exc}")
            return False
        return True

    def _maybe_compact_locked(self) -> None:
        if self.log.records <= 2 * len(self._index) + _COMPACT_MIN:
            return
        try:
            self.log.rewrite(self._index)
            self.n["compactions"] += 1
        except OSError as exc:  # the old log is intact; tried again after more puts
            self.n["index_errors"] += 1
            self.warn_once("compact", f"index compaction failed: {exc}")

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._free.clear()
