"""Eviction policies: which evictable leaf goes first.

Each policy is a pure function from a node to a sort key; the smallest key is evicted first.
``access_tick`` (a counter the tree bumps on every access) breaks ties in timestamps, so the
order is exact even when many accesses share one clock reading. :class:`EvictionHeap` keeps a
tree's evictable leaves in that order, lazily.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable
from typing import TypeAlias

from hicache.radix.node import TreeNode

__all__ = ["EvictionHeap", "EvictionPolicy", "SortKey", "eviction_key"]


# A node's place in the eviction order, compared element by element (bools and ints included).
SortKey: TypeAlias = tuple[float, ...]


class EvictionPolicy(enum.Enum):
    LRU = "lru"  # least recently used first
    LFU = "lfu"  # fewest hits first, then least recently used
    FIFO = "fifo"  # oldest creation first
    MRU = "mru"  # most recently used first
    FILO = "filo"  # newest creation first
    PRIORITY = "priority"  # lowest priority first, then least recently used
    SLRU = "slru"  # probation segment before protected, each least recently used first


def _lru(n: TreeNode) -> SortKey:
    return (n.last_access_time, n.access_tick)


def _lfu(n: TreeNode) -> SortKey:
    return (n.hit_count, n.last_access_time, n.access_tick)


def _fifo(n: TreeNode) -> SortKey:
    return (n.creation_time, n.id)


def _mru(n: TreeNode) -> SortKey:
    return (-n.last_access_time, -n.access_tick)


def _filo(n: TreeNode) -> SortKey:
    return (-n.creation_time, -n.id)


def _priority(n: TreeNode) -> SortKey:
    return (n.priority, n.last_access_time, n.access_tick)


def _slru(n: TreeNode) -> SortKey:
    return (n.protected, n.last_access_time, n.access_tick)


_KEYS: dict[EvictionPolicy, Callable[[TreeNode], SortKey]] = {
    EvictionPolicy.LRU: _lru,
    EvictionPolicy.LFU: _lfu,
    EvictionPolicy.FIFO: _fifo,
    EvictionPolicy.MRU: _mru,
    EvictionPolicy.FILO: _filo,
    EvictionPolicy.PRIORITY: _priority,
    EvictionPolicy.SLRU: _slru,
}


def eviction_key(policy: EvictionPolicy) -> Callable[[TreeNode], SortKey]:
    """The sort key of ``policy``: smaller is evicted first."""
    return _KEYS[policy]


class EvictionHeap:
    """A tree's evictable leaves by ``order`` (smallest sort key first), kept lazily: a node is
    pushed again whenever its key may have changed (its ``heap_version`` marks the current
    entry) and stale entries are dropped as they come off, so an eviction costs O(log n) per
    node instead of a scan of the tree. Whether a popped node may still go is the tree's call."""

    def __init__(self, order: Callable[[TreeNode], SortKey]) -> None:
        self.order = order
        self._entries: list[tuple[SortKey, int, int, TreeNode]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: TreeNode) -> None:
        """Queue ``node`` under its sort key now; its earlier entries go stale."""
        node.heap_version += 1
        heapq.heappush(self._entries, (self.order(node), node.heap_version, node.id, node))

    def pop(self) -> TreeNode | None:
        """The node of the first current entry, taken off; None when no entry is left."""
        while self._entries:
            _, version, _, node = heapq.heappop(self._entries)
            if version == node.heap_version:
                return node
        return None

    def clear(self) -> None:
        self._entries = []
