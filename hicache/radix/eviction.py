"""Eviction policies: which evictable leaf goes first.

Each policy is a pure function from a node to a sort key; the smallest key is evicted first.
``access_tick`` (a counter the tree bumps on every access) breaks ties in timestamps, so the
order is exact even when many accesses share one clock reading.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeAlias

from hicache.radix.node import TreeNode

__all__ = ["EvictionPolicy", "SortKey", "eviction_key"]


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
