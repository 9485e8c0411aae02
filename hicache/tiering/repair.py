"""Repairing L3: keys whose stored object failed its checks are suspects until rewritten.

A prefetch that reads a corrupt, truncated or foreign object counts it as a miss, deletes it
(best effort) and adds its key here. A write of a suspect key does not trust ``exists`` (the
delete may have failed, or another process may have written the same bad bytes back) and
writes the page again; a write that lands clears the suspicion. So a damaged page stays a miss
only until some request recomputes it, instead of cutting every prefix through it for good.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["SuspectKeys"]


class SuspectKeys:
    """A bounded set of keys, oldest forgotten first (a forgotten key costs one more miss)."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def discard(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def vouched(self, keys: Sequence[str], found: Sequence[bool]) -> list[bool]:
        """``found`` (an ``exists`` answer for ``keys``), with every suspect key reported
        absent."""
        if not self._keys:
            return list(found)
        return [ok and key not in self._keys for key, ok in zip(keys, found, strict=True)]
