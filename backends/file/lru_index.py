"""The file backend's size cap: this process's view of the store in LRU order, and pins.

Sizes are kept least recently used first; reads and publishes pin their key so that eviction
never removes an object a thread of this process is reading or about to publish. Everything
runs under one lock, and eviction unlinks victims while holding it, so a delete or a publish of
the same key cannot interleave with the unlink.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

__all__ = ["LruIndex"]


class LruIndex:
    """Object sizes by key, least recent first, with a byte cap (``None``: no cap)."""

    def __init__(self, max_bytes: int | None, evict: Callable[[str], None]) -> None:
        self.lock = threading.Lock()
        self.max_bytes = max_bytes
        self.used = 0
        self.evictions = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._pins: dict[str, int] = {}  # keys this process is reading or publishing
        self._evict = evict  # removes one object's file; called under the lock

    def __len__(self) -> int:
        return len(self._sizes)

    def load(self, found: Iterable[tuple[str, int]]) -> None:
        """Replace the index with ``(key, size)`` pairs, oldest first, and apply the cap (it
        may have been lowered since the store was written)."""
        with self.lock:
            self._sizes = OrderedDict(found)
            self.used = sum(self._sizes.values())
            self._make_room_locked(0, exclude="")

    def clear(self) -> None:
        with self.lock:
            self._sizes.clear()
            self.used = 0

    def admit(self, key: str, size: int) -> bool:
        """Account ``size`` bytes for ``key`` (evicting if needed) and pin it until published;
        False when the cap cannot make room."""
        with self.lock:
            old = self._sizes.get(key, 0)
            if not self._make_room_locked(size - old, exclude=key):
                return False
            self._sizes.pop(key, None)
            self._sizes[key] = size
            self.used += size - old
            self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def pin(self, key: str) -> None:
        with self.lock:
            self._pins[key] = self._pins.get(key, 0) + 1

    def settle(self, key: str, size: int | None, present: bool) -> None:
        """Unpin ``key`` after a read or publish; note its size, or drop it when it is gone."""
        with self.lock:
            left = self._pins[key] - 1
            if left:
                self._pins[key] = left
            else:
                del self._pins[key]
            if size is not None:
                old = self._sizes.pop(key, 0)  # another process may have replaced or written it
                self._sizes[key] = size
                self.used += size - old
            elif not present:
                self.drop_locked(key)

    def drop_locked(self, key: str) -> None:
        """Forget ``key``; the caller holds :attr:`lock`."""
        self.used -= self._sizes.pop(key, 0)

    def _make_room_locked(self, extra: int, exclude: str) -> bool:
        """Evict least recently used, unpinned objects until ``extra`` more bytes fit."""
        cap = self.max_bytes
        need = 0 if cap is None else self.used + extra - cap
        victims: list[str] = []
        for key, size in self._sizes.items():
            if need <= 0:
                break
            if key != exclude and key not in self._pins:
                victims.append(key)
                need -= size
        if need > 0:
            return False
        for key in victims:
            self.used -= self._sizes.pop(key)
            self.evictions += 1
            self._evict(key)
        return True
