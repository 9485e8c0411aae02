"""Pins: locks on tree nodes that expire on their own (``RadixCache.pin``).

A pin is one tree lock on its node (``inc_lock_ref``) with an expiry time. :class:`Pins` keeps
the pinned nodes, soonest expiry first; the tree takes the lock when it adds a pin and lets it
go for every node that :meth:`Pins.expired` (checked at each eviction) or :meth:`Pins.remove`
gives back.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from hicache.radix.node import TreeNode

__all__ = ["Pins"]


class Pins:
    """The pins of one tree: (expiry, order of pinning, node), soonest expiry first."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._order = itertools.count(1)  # ties in expiry go by order of pinning
        self._heap: list[tuple[float, int, TreeNode]] = []

    def add(self, node: TreeNode, ttl_s: float) -> None:
        """Pin ``node`` for ``ttl_s`` seconds from now (the caller holds its lock)."""
        heapq.heappush(self._heap, (self._clock() + ttl_s, next(self._order), node))

    def remove(self, node: TreeNode) -> bool:
        """Take one pin of ``node`` off before it expires; whether it had one."""
        for i, (_, _, pinned) in enumerate(self._heap):
            if pinned is node:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def expired(self) -> list[TreeNode]:
        """Take off every pin whose time is up; their nodes, one entry a pin (the caller lets
        go of one lock for each)."""
        now, out = self._clock(), []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out
