"""What the tier knows about which chunks its backend holds, shared by the scheduler thread
(lookups) and the tier's loop thread (probe, store and load results)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from enum import Enum

__all__ = ["Verdict", "Verdicts"]


class Verdict(Enum):
    STORED = "stored"
    ABSENT = "absent"
    PROBING = "probing"
    UNKNOWN = "unknown"


class Verdicts:
    """Keys known stored, keys known absent (for ``miss_ttl_s``), and keys being probed (queued
    for a batched probe, then sent).

    Bounded: past ``max_keys`` the oldest verdicts are forgotten, which only costs a new probe.
    """

    def __init__(self, miss_ttl_s: float, max_keys: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._absent: OrderedDict[bytes, float] = OrderedDict()
        self._probing: set[bytes] = set()
        self._queued: list[bytes] = []  # probing, not yet sent
        self._miss_ttl_s = miss_ttl_s
        self._max_keys = max_keys

    def get(self, key: bytes) -> Verdict:
        """The verdict for ``key``; UNKNOWN also for an absent verdict older than the TTL."""
        with self._lock:
            return self._verdict(key)

    def check(self, key: bytes) -> tuple[Verdict, bool]:
        """:meth:`get` for a lookup: an UNKNOWN key is queued for a probe and is PROBING from
        then on; the flag says it is the first queued since the last :meth:`take_queued` (the
        caller schedules the probe). One lock for it all: it runs on every lookup."""
        with self._lock:
            verdict = self._verdict(key)
            if verdict is not Verdict.UNKNOWN:
                return verdict, False
            self._probing.add(key)
            self._queued.append(key)
            return Verdict.PROBING, len(self._queued) == 1

    def _verdict(self, key: bytes) -> Verdict:
        """:meth:`get` under the lock."""
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

    def queued(self) -> bool:
        return bool(self._queued)  # a racy read is fine: a key queued later schedules its own

    def take_queued(self) -> list[bytes]:
        """The keys queued for a probe, emptying the queue."""
        with self._lock:
            keys, self._queued = self._queued, []
            return keys

    def end_probes(self, keys: list[bytes], found: list[bool]) -> None:
        """The answers of one probe batch."""
        with self._lock:
            for key, present in zip(keys, found, strict=True):
                self._probing.discard(key)
                self._set(key, present)

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
