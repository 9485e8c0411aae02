"""Backends that wrap another backend to add one cross-cutting behaviour.

A wrapper is a :class:`StorageBackend` whose storage is another backend (``inner``); see
:mod:`.base`. Wrappers are built in code, ``LatencyBackend(MemoryBackend(),
LatencyConfig(latency_s=0.002))``, not from URLs (:class:`ThreadedBackend` opens its inner
backend from a URL itself, with :meth:`ThreadedBackend.open_url`).

- :class:`FaultInjectionBackend` (``faults``) fails, stalls or corrupts calls, deterministically
  by seed, so tests can drive the cache controller against unreliable storage.
- :class:`LatencyBackend` (``latency``) adds a per-call latency and a bandwidth-limited link
  shared by concurrent calls, with an injectable clock and sleep so tests run on fake time.
- :class:`ThreadedBackend` (``threaded``) runs a backend whose "async" methods block on an event
  loop of its own, in a thread of its own, so the caller's loop never stalls behind it.
"""

from hicache.backends.wrappers.base import SleepFn, WrapperBackend
from hicache.backends.wrappers.faults import (
    FaultConfig,
    FaultInjectionBackend,
    FaultMode,
    Operation,
)
from hicache.backends.wrappers.latency import LatencyBackend, LatencyConfig
from hicache.backends.wrappers.threaded import ThreadedBackend

__all__ = [
    "FaultConfig",
    "FaultInjectionBackend",
    "FaultMode",
    "LatencyBackend",
    "LatencyConfig",
    "Operation",
    "SleepFn",
    "ThreadedBackend",
    "WrapperBackend",
]
