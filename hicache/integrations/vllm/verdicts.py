"""What the tier knows about which chunks its backend holds, shared by the scheduler thread
(lookups) and the tier's loop thread (probe, store and load results)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from enum import Enum

__all__ = ["ProbeQueue", "Verdict", "Verdicts"]


class Verdict(Enum):
    STORED = "stored"
    ABSENT = "absent"
    PROBING = "probing"
    UNKNOWN = "unknown"


class Verdicts:
    """Keys known stored, keys known absent (for ``miss_ttl_s``), and keys being probed.

    Bounded: past ``max_keys`` the oldest verdicts are forgotten, which only costs a new probe.
    """

    def __init__(self, miss_ttl_s: float, max_keys: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._absent: OrderedDict[bytes, float] = OrderedDict()
        self._probing: set[bytes] = set()
        self._miss_ttl_s = miss_ttl_s
        self._max_keys = max_keys

    def get(self, key: bytes) -> Verdict:
        """The verdict for ``key``; UNKNOWN also for an absent verdict older than the TTL."""
        with self._lock:
            if key in self._stored:
                self._stored.move_to_end(key)
                return Verdict.STORED
            if key in self._probing:
                return Verdict.PROBING
            since = self._absent.get(key)
            if since is not None:
                if time.monotonic() - since < self._miss_ttl_s:
                    return Verdict.ABSENT
                del self._absent[key]  # stale: another writer may have stored it since
            return Verdict.UNKNOWN

    def start_probe(self, key: bytes) -> bool:
        """Mark ``key`` as being probed; False when a probe is already running."""
        with self._lock:
            if key in self._probing:
                return False
            self._probing.add(key)
            return True

    def end_probe(self, key: bytes, found: bool) -> None:
        with self._lock:
            self._probing.discard(key)
            self._set(key, found)

    def mark(self, keys: list[bytes], found: bool) -> None:
        with self._lock:
            for key in keys:
                self._set(key, found)

    def _set(self, key: bytes, found: bool) -> None:
        if found:
            self._absent.pop(key, None)
            self._stored[key] = None
            self._stored.move_to_end(key)
            if len(self._stored) > self._max_keys:
                self._stored.popitem(last=False)
        else:
            self._stored.pop(key, None)
            self._absent[key] = time.monotonic()
            self._absent.move_to_end(key)
            if len(self._absent) > self._max_keys:
                self._absent.popitem(last=False)


class ProbeQueue:
    """Keys whose existence is to be checked, gathered on the scheduler thread so that the
    lookups of one step cost one batched ``exists`` on the loop thread, not one each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: list[bytes] = []

    def add(self, key: bytes) -> bool:
        """Queue ``key``; True when the queue was empty (the caller schedules a flush)."""
        with self._lock:
            self._keys.append(key)
            return len(self._keys) == 1

    def take(self) -> list[bytes]:
        """Every queued key, emptying the queue (the next :meth:`add` schedules again)."""
        with self._lock:
            keys, self._keys = self._keys, []
            return keys
