"""The process's Mooncake clients, shared by every ``mooncake`` backend with the same settings.

A Mooncake client is heavy: it mounts its segment into the cluster, listens on ports, runs
its own threads, and its ``close()`` takes 1.5-3 s while holding the GIL (measured: no other
Python thread runs meanwhile). So backends opened with the same settings share one client,
counted by reference; the last ``release`` closes it. Everything done on a client runs on its
connection's single worker thread, which serialises the calls (the client is not documented as
thread-safe, and the staging buffer is shared).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hicache.backends.mooncake.client import MooncakeClient, SetupParams, master_address
from hicache.backends.mooncake.gate import Gate, RateLimitedLog, reachable

__all__ = ["Connection", "Unavailable"]

logger = logging.getLogger("hicache.backends.mooncake")
T = TypeVar("T")
_Key = tuple[SetupParams, int, float, float]  # setup, staging bytes, backoff, rebuild after


class Unavailable(Exception):
    """The master is known to be down; the call was not tried (internal, never escapes)."""


_SHARED: dict[_Key, Connection] = {}
_SHARED_LOCK = threading.Lock()


class Connection:
    """One set-up client, its worker thread, and what it knows about the master's health."""

    def __init__(self, key: _Key, store_cls: Any) -> None:
        self._key = key
        self._store_cls = store_cls
        self.params, self._staging_bytes, backoff_s, rebuild_after_s = key
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-mooncake")
        self.lock = threading.Lock()  # the client, for register_memory from other threads
        self.gate = Gate(backoff_s, rebuild_after_s)
        self.log = RateLimitedLog(logger, interval_s=30.0)
        self.client: MooncakeClient | None = None
        self.rebuilds = 0
        self._refs = 0

    @classmethod
    def acquire(cls, store_cls: Any, key: _Key) -> Connection:
        """The shared connection for ``key``, set up if new (blocking: call it in a thread)."""
        with _SHARED_LOCK:
            conn = _SHARED.get(key)
            if conn is None:
                conn = cls(key, store_cls)
                try:
                    conn.executor.submit(conn._setup).result()
                except BaseException:
                    conn.executor.shutdown(wait=False)
                    raise
                _SHARED[key] = conn
            conn._refs += 1
            return conn

    def release(self) -> None:
        """Drop one reference; the last one closes the client (blocking: 1.5-3 s)."""
        with _SHARED_LOCK:
            self._refs -= 1
            if self._refs > 0:
                return
            _SHARED.pop(self._key, None)
        self.executor.submit(self._teardown).result()
        self.executor.shutdown(wait=True)

    def run(self, op: Callable[[MooncakeClient], T]) -> T:
        """``op`` on the client (on the worker thread); :class:`Unavailable` if the master is
        known to be down and has not come back yet."""
        now, gate = time.monotonic(), self.gate
        if not gate.may_try(now):
            raise Unavailable
        if gate.down and not reachable(*master_address(self.params.master), 0.2):
            gate.failed(now)  # still down: wait longer before the next probe
            raise Unavailable
        if gate.should_rebuild(now):
            self._rebuild(now)
        with self.lock:
            if self.client is None:
                raise Unavailable
            return op(self.client)

    def _setup(self) -> None:
        self.client = MooncakeClient(self._store_cls, self.params, self._staging_bytes)

    def _teardown(self) -> None:
        with self.lock:
            client, self.client = self.client, None
        if client is not None:
            client.close()

    def _rebuild(self, now: float) -> None:
        """A new client (setup again): the master answers but calls kept failing."""
        self.gate.rebuilt(now)
        try:
            fresh = MooncakeClient(self._store_cls, self.params, self._staging_bytes)
        except Exception as exc:
            self.log.warning(
                "rebuild", "mooncake: reconnecting to %s failed: %s", self.params.master, exc
            )
            return
        with self.lock:
            old, self.client = self.client, fresh
            if old is not None:
                fresh.adopt_regions(old.regions)
        self.rebuilds += 1
        if old is not None:
            old.close()
