"""The shared index of an ``shm`` segment: hash table, LRU list and block allocator.

Everything here lives in the segment's shared arrays (see :mod:`hicache.backends.shm.layout`)
and every method must be called inside ``SharedIndex.locked()``.

- Keys hash (63 bits of BLAKE2b: the same in every process, unlike ``hash()``) into buckets
  chained through each entry's CHAIN field; entries never move, so a reader's (slot,
  generation) pair names one version of one object.
- Published (READY) entries sit on a doubly linked LRU list: touch and evict are O(1).
- Data lives in fixed blocks taken from a free stack. An object is a chain of extents (runs of
  consecutive blocks), so variable sizes and eviction need no compaction; freed blocks go back
  in descending order, so the next object of the same size gets the same contiguous run and is
  copied in one piece.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from hicache.backends.base import ObjectInfo
from hicache.backends.shm.layout import ENTRY_WORDS, KEY_OFFSET, EntryState, Hdr, SegmentFile

__all__ = ["SharedIndex", "Ticket", "key_hash"]

logger = logging.getLogger(__name__)

_WRITING = int(EntryState.WRITING)
_READY = int(EntryState.READY)
_FREE = int(EntryState.FREE)

# Fields of an entry record (int64 words; plain ints, not an enum, on the hot path).
_STATE = 0
_KEYLEN = 1
_HASH = 2
_GEN = 3  # bumped on every state change: a reader's seqlock
_SIZE = 4
_HEAD = 5  # first block of the first extent, -1 for an empty object
_CHAIN = 6  # next entry in the same hash bucket
_PREV = 7  # LRU neighbours; PREV is towards the head (most recently used)
_NEXT = 8
_OWNER = 9  # the writer's owner slot, epoch and pid: is it still alive?
_EPOCH = 10
_PID = 11
_MTIME_NS = 12
_W = ENTRY_WORDS


def key_hash(key: bytes) -> int:
    """63 bits of BLAKE2b: the same in every process (unlike ``hash()``), fits an int64."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class Ticket(NamedTuple):
    """One entry as seen under the lock: where its bytes are, and the generation to re-check.

    A named tuple, not a frozen dataclass: one is built per object per call, on the hot path.
    """

    slot: int
    gen: int
    size: int
    extents: tuple[tuple[int, int], ...]  # (offset in the data area, bytes), covering `size`
    key: bytes
    hash: int


class SharedIndex:
    """Index operations over one mapped segment. Not thread-safe on its own: use ``locked``."""

    def __init__(self, seg: SegmentFile, pid: int) -> None:
        self.seg = seg
        self.pid = pid
        self.block_bytes = seg.geometry.block_bytes
        self._mask = seg.geometry.n_buckets - 1
        self._ent = seg.entries
        self._hdr = seg.header
        self._blocks = seg.blocks
        self._records = seg.arrays["entries"].reshape(-1, _W)
        self._stack_np = seg.arrays["block_stack"]
        #: Reservations of this instance not yet published or abandoned: never dead, so a
        #: writer short of space skips the reclaim scan when they are all there is.
        self.own_writing = 0

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self.seg.locked() as dirty:
            if dirty:
                self._repair()
            yield

    # ----- lookups ----------------------------------------------------------------------------
    def find(self, key: bytes, h: int) -> int:
        ent, keys, n = self._ent, self.seg.key_bytes, len(key)
        e = self.seg.buckets[h & self._mask]
        while e >= 0:
            base = e * _W
            if ent[base + _HASH] == h and ent[base + _KEYLEN] == n:
                off = base * 8 + KEY_OFFSET
                if keys[off : off + n] == key:
                    return int(e)
            e = ent[base + _CHAIN]
        return -1

    def open_read(self, key: bytes, h: int) -> Ticket | None:
        """The published object under ``key``, marked most recently used; None if absent."""
        e = self.find(key, h)
        if e < 0:
            return None
        if self._hdr[Hdr.LRU_HEAD] != e:
            self._lru_remove(e)
            self._lru_push(e)
        return self._ticket(e, key, h)

    def valid(self, ticket: Ticket) -> bool:
        """Whether the entry is unchanged since the ticket: its bytes were not reused."""
        return bool(self._ent[ticket.slot * _W + _GEN] == ticket.gen)

    def listing(self, prefix: str) -> list[ObjectInfo]:
        ent, keys, wanted = self._ent, self.seg.key_bytes, prefix.encode()
        out: list[ObjectInfo] = []
        for e in np.flatnonzero(self._records[:, _STATE] == _READY).tolist():
            base = e * _W
            off = base * 8 + KEY_OFFSET
            key = bytes(keys[off : off + ent[base + _KEYLEN]])
            if key.startswith(wanted):
                mtime = ent[base + _MTIME_NS] / 1e9
                out.append(ObjectInfo(key.decode(), ent[base + _SIZE], mtime))
        return out

    # ----- writes -----------------------------------------------------------------------------
    def reserve(self, key: bytes, h: int, size: int) -> Ticket | None:
        """Blocks and a WRITING entry for ``size`` bytes, evicting LRU objects; None if no room."""
        seg, ent, hdr = self.seg, self._ent, self._hdr
        n_blocks = -(-size // self.block_bytes)
        if not self._make_room(n_blocks):
            return None
        top = hdr[Hdr.FREE_ENTRIES] - 1
        e = seg.entry_stack[top]
        hdr[Hdr.FREE_ENTRIES] = top
        base = e * _W
        off = base * 8 + KEY_OFFSET
        seg.key_bytes[off : off + len(key)] = key
        ent[base + _KEYLEN] = len(key)
        ent[base + _HASH] = h
        ent[base + _SIZE] = size
        ent[base + _HEAD] = self._alloc_blocks(n_blocks) if n_blocks else -1
        ent[base + _OWNER], ent[base + _EPOCH], ent[base + _PID] = seg.owner, seg.epoch, self.pid
        ent[base + _CHAIN] = ent[base + _PREV] = ent[base + _NEXT] = -1
        ent[base + _STATE] = _WRITING
        ent[base + _GEN] += 1
        hdr[Hdr.WRITING] += 1
        self.own_writing += 1
        return self._ticket(e, key, h)

    def publish(self, ticket: Ticket) -> bool:
        """Make a reservation visible, replacing any older object under its key."""
        ent, hdr, e, h = self._ent, self._hdr, ticket.slot, ticket.hash
        base = e * _W
        self.own_writing -= 1
        if ent[base + _GEN] != ticket.gen or ent[base + _STATE] != _WRITING:
            return False  # reclaimed or repaired away meanwhile
        old = self.find(ticket.key, h)
        if old >= 0:
            self._drop(old)
        hdr[Hdr.WRITING] -= 1
        ent[base + _STATE] = _READY
        ent[base + _GEN] += 1
        ent[base + _MTIME_NS] = time.time_ns()
        b = h & self._mask
        ent[base + _CHAIN] = self.seg.buckets[b]
        self.seg.buckets[b] = e
        self._lru_push(e)
        hdr[Hdr.OBJECTS] += 1
        hdr[Hdr.USED_BYTES] += ticket.size
        return True

    def abandon(self, ticket: Ticket) -> None:
        """Give back a reservation that will not be published."""
        self.own_writing -= 1
        base = ticket.slot * _W
        if self._ent[base + _GEN] == ticket.gen and self._ent[base + _STATE] == _WRITING:
            self._release_writing(ticket.slot)

    def remove(self, key: bytes, h: int) -> bool:
        e = self.find(key, h)
        if e >= 0:
            self._drop(e)
        return e >= 0

    def reclaim_dead(self) -> int:
        """Free the reservations of writers that died before publishing; how many were."""
        ent = self._ent
        alive: dict[tuple[int, int, int], bool] = {}
        reclaimed = 0
        for e in np.flatnonzero(self._records[:, _STATE] == _WRITING).tolist():
            base = e * _W
            who = (ent[base + _OWNER], ent[base + _EPOCH], ent[base + _PID])
            if who not in alive:
                alive[who] = self.seg.writer_alive(*who)
            if not alive[who]:
                self._release_writing(e)
                reclaimed += 1
        if reclaimed:
            self._hdr[Hdr.RECLAIMED] += reclaimed
            logger.warning("%s: reclaimed %d writes of dead processes", self.seg.path, reclaimed)
        return reclaimed

    def counters(self) -> dict[str, int | float]:
        hdr, geo = self._hdr, self.seg.geometry
        return {
            "objects": hdr[Hdr.OBJECTS],
            "used_bytes": hdr[Hdr.USED_BYTES],
            "capacity_bytes": geo.capacity_bytes,
            "free_bytes": hdr[Hdr.FREE_BLOCKS] * geo.block_bytes,
            "writing": hdr[Hdr.WRITING],
            "evictions": hdr[Hdr.EVICTIONS],
            "reclaimed_dead_writes": hdr[Hdr.RECLAIMED],
            "torn_read_retries": hdr[Hdr.TORN_RETRIES],
        }

    def count_torn(self, n: int) -> None:
        self._hdr[Hdr.TORN_RETRIES] += n

    # ----- internals --------------------------------------------------------------------------
    def _ticket(self, e: int, key: bytes, h: int) -> Ticket:
        ent, blocks, bb = self._ent, self._blocks, self.block_bytes
        base = e * _W
        size = remaining = ent[base + _SIZE]
        extents: list[tuple[int, int]] = []
        b = ent[base + _HEAD]
        while b >= 0 and remaining > 0:
            n = min(blocks[2 * b + 1] * bb, remaining)
            extents.append((b * bb, n))
            remaining -= n
            b = blocks[2 * b]
        return Ticket(e, ent[base + _GEN], size, tuple(extents), key, h)

    def _make_room(self, n_blocks: int) -> bool:
        hdr = self._hdr
        if n_blocks > self.seg.geometry.n_blocks:
            return False
        tried_reclaim = False
        while hdr[Hdr.FREE_BLOCKS] < n_blocks or hdr[Hdr.FREE_ENTRIES] == 0:
            # Dead writers' blocks first: they hold nothing anyone can read.
            if not tried_reclaim and hdr[Hdr.WRITING] > self.own_writing:
                tried_reclaim = True
                if self.reclaim_dead():
                    continue
            tail = hdr[Hdr.LRU_TAIL]
            if tail < 0:
                return False
            self._drop(tail)
            hdr[Hdr.EVICTIONS] += 1
        return True

    def _alloc_blocks(self, n: int) -> int:
        """Pop ``n`` free blocks, chain them as extents, return the first block."""
        blocks, hdr = self._blocks, self._hdr
        top = hdr[Hdr.FREE_BLOCKS]
        taken: list[int] = self._stack_np[top - n : top][::-1].tolist()
        hdr[Hdr.FREE_BLOCKS] = top - n
        # Plain Python over a list: cheaper than numpy for the usual handful of extents.
        head = first = taken[0]
        run = 1
        for b in taken[1:]:
            if b == first + run:
                run += 1
                continue
            blocks[2 * first], blocks[2 * first + 1] = b, run
            first, run = b, 1
        blocks[2 * first], blocks[2 * first + 1] = -1, run
        return head

    def _free_blocks(self, head: int) -> None:
        """Push an object's blocks back, lowest on top, so they are popped again as one run."""
        blocks = self._blocks
        extents: list[tuple[int, int]] = []
        b = head
        while b >= 0:
            extents.append((b, blocks[2 * b + 1]))
            b = blocks[2 * b]
        top = self._hdr[Hdr.FREE_BLOCKS]
        for start, run in sorted(extents, reverse=True):
            self._stack_np[top : top + run] = np.arange(start + run - 1, start - 1, -1)
            top += run
        self._hdr[Hdr.FREE_BLOCKS] = top

    def _release_entry(self, e: int) -> None:
        ent, hdr = self._ent, self._hdr
        base = e * _W
        self._free_blocks(ent[base + _HEAD])
        ent[base + _HEAD] = -1
        ent[base + _STATE] = _FREE
        ent[base + _GEN] += 1
        top = hdr[Hdr.FREE_ENTRIES]
        self.seg.entry_stack[top] = e
        hdr[Hdr.FREE_ENTRIES] = top + 1

    def _release_writing(self, e: int) -> None:
        self._hdr[Hdr.WRITING] -= 1
        self._release_entry(e)

    def _drop(self, e: int) -> None:
        """Unpublish a READY entry and free its blocks."""
        ent, hdr, buckets = self._ent, self._hdr, self.seg.buckets
        base = e * _W
        b = ent[base + _HASH] & self._mask
        prev, cur = -1, buckets[b]
        while cur != e:
            prev, cur = cur, ent[cur * _W + _CHAIN]
        if prev < 0:
            buckets[b] = ent[base + _CHAIN]
        else:
            ent[prev * _W + _CHAIN] = ent[base + _CHAIN]
        self._lru_remove(e)
        hdr[Hdr.OBJECTS] -= 1
        hdr[Hdr.USED_BYTES] -= ent[base + _SIZE]
        self._release_entry(e)

    def _lru_push(self, e: int) -> None:
        ent, hdr = self._ent, self._hdr
        head = hdr[Hdr.LRU_HEAD]
        ent[e * _W + _PREV], ent[e * _W + _NEXT] = -1, head
        if head >= 0:
            ent[head * _W + _PREV] = e
        else:
            hdr[Hdr.LRU_TAIL] = e
        hdr[Hdr.LRU_HEAD] = e

    def _lru_remove(self, e: int) -> None:
        ent, hdr = self._ent, self._hdr
        prev, nxt = ent[e * _W + _PREV], ent[e * _W + _NEXT]
        if prev >= 0:
            ent[prev * _W + _NEXT] = nxt
        else:
            hdr[Hdr.LRU_HEAD] = nxt
        if nxt >= 0:
            ent[nxt * _W + _PREV] = prev
        else:
            hdr[Hdr.LRU_TAIL] = prev

    def _repair(self) -> None:
        """Rebuild the index after a process died holding the lock mid-update.

        The index may be half-changed, so published objects are dropped (it is a cache) and
        every generation is bumped, which turns reads in flight into misses. Live writers'
        reservations are kept with their blocks, since they are still copying into them.
        """
        seg, rec, hdr = self.seg, self._records, self._hdr
        keep = [
            e
            for e in np.flatnonzero(rec[:, _STATE] == _WRITING).tolist()
            if seg.writer_alive(*rec[e, _OWNER : _PID + 1].tolist())
        ]
        rec[:, _GEN] += 1
        rec[:, _STATE] = _FREE
        in_use = np.zeros(seg.geometry.n_blocks, dtype=bool)
        for e in keep:
            rec[e, _STATE] = _WRITING
            rec[e, _GEN] -= 1  # the writer's ticket stays good: it publishes as usual
            b = int(rec[e, _HEAD])
            while b >= 0:
                in_use[b : b + self._blocks[2 * b + 1]] = True
                b = self._blocks[2 * b]
        free_blocks = np.flatnonzero(~in_use)[::-1]
        self._stack_np[: len(free_blocks)] = free_blocks
        free_entries = np.flatnonzero(rec[:, _STATE] == _FREE)[::-1]
        seg.arrays["entry_stack"][: len(free_entries)] = free_entries
        seg.arrays["buckets"][:] = -1
        values = {
            Hdr.FREE_BLOCKS: len(free_blocks),
            Hdr.FREE_ENTRIES: len(free_entries),
            Hdr.LRU_HEAD: -1,
            Hdr.LRU_TAIL: -1,
            Hdr.OBJECTS: 0,
            Hdr.USED_BYTES: 0,
            Hdr.WRITING: len(keep),
        }
        for slot, value in values.items():
            hdr[slot] = value
        logger.error("%s: a process died inside the index lock; index rebuilt", seg.path)
