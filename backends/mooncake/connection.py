"""The process's Mooncake clients, shared by every ``mooncake`` backend with the same settings.

A Mooncake client is heavy: it mounts its segment into the cluster, listens on ports, runs
its own threads, and its ``close()`` takes 1.5-3 s while holding the GIL (measured: no other
Python thread runs meanwhile). So backends opened with the same settings share one client,
counted by reference; the last ``release`` closes it. Everything done on a client runs on its
connection's single worker thread, which serialises the calls (the client is not documented as
thread-safe, and the staging buffer is shared).

Closing with the master gone: the client's ``close()`` then waits out the master's RPC timeouts
for 14-19 s (measured), and it holds the GIL throughout (Mooncake's binding does not release it),
so a thread cannot keep it off the event loop: every thread of the process stops. So the last
``release`` first checks, on the worker thread and within a deadline, that the master still
answers (a TCP probe of its port, then one ``batch_is_exist`` round trip, which does release the
GIL). If it does not, the client is not closed but abandoned: kept referenced until the process
exits (Mooncake's exit handler tears it down then; its segment left the cluster with the
master), logged once, and counted by the backend (``close_abandoned``).
:func:`close_abandoned` closes the abandoned clients whose master answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hicache.backends.mooncake.client import (
    MooncakeClient,
    SetupParams,
    lost_master,
    master_address,
)
from hicache.backends.mooncake.gate import Gate, RateLimitedLog, reachable

__all__ = ["Connection", "Unavailable", "close_abandoned"]

logger = logging.getLogger("hicache.backends.mooncake")
T = TypeVar("T")
_Key = tuple[SetupParams, int, float, float]  # setup, staging bytes, backoff, rebuild after


class Unavailable(Exception):
    """The master is known to be down; the call was not tried (internal, never escapes)."""


_SHARED: dict[_Key, Connection] = {}
_SHARED_LOCK = threading.Lock()
_ABANDONED: list[MooncakeClient] = []  # left open at close: their master did not answer
_PROBE_KEY = "hicache#close-probe"  # outside the key alphabet: never a stored object
_PROBE_TIMEOUT_S = 0.5  # TCP connect to the master before closing


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
        self._close_lock = threading.Lock()
        self._gave_up = False  # release stopped waiting: the teardown must not close
        self._closing = False  # the teardown is inside ``close()``: it cannot be stopped

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

    def release(self, deadline_s: float) -> bool:
        """Drop one reference; the last one closes the client (blocking: call it in a thread).

        False when the client was abandoned instead: its master did not answer, or the worker
        did not get to the teardown within ``deadline_s`` (a call in flight waiting out a dead
        master's timeout). A close that has begun is waited for: it cannot be interrupted.
        """
        with _SHARED_LOCK:
            self._refs -= 1
            if self._refs > 0:
                return True
            _SHARED.pop(self._key, None)
        future = self.executor.submit(self._teardown)
        try:
            closed = future.result(timeout=deadline_s)
        except TimeoutError:
            with self._close_lock:
                self._gave_up = not self._closing
            closed = False if self._gave_up else future.result()
        self.executor.shutdown(wait=closed)
        return closed

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

    def _teardown(self) -> bool:
        """Close the client if the master answers, else abandon it (worker thread)."""
        alive = not self._gave_up and self._master_answers()
        with self.lock:
            client, self.client = self.client, None
        with self._close_lock:
            if client is None:
                return True
            if self._gave_up or not alive:
                _abandon(client, "did not answer" if not alive else "was too slow to answer")
                return False
            self._closing = True
        client.close()  # holds the GIL for 1.5-3 s: every thread waits
        return True

    def _master_answers(self) -> bool:
        """Whether the master answers this connection's client (worker thread)."""
        with self.lock:
            return self.client is not None and _answers(self.client)

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


def _abandon(client: MooncakeClient, why: str) -> None:
    """Keep ``client`` referenced and open: closing it would stop the process for seconds."""
    _ABANDONED.append(client)
    logger.warning(
        "mooncake: the master %s %s at close; its client is left open until the process "
        "exits (closing it would stop every thread while it waits out the master's timeouts)",
        client.params.master,
        why,
    )


def close_abandoned() -> int:
    """Close the abandoned clients whose master answers again; how many are left.

    Blocking, and each close holds the GIL for 1.5-3 s: for tests and shutdown paths.
    """
    for client in list(_ABANDONED):
        if _answers(client):
            _ABANDONED.remove(client)
            client.close()
    return len(_ABANDONED)


def _answers(client: MooncakeClient) -> bool:
    """Whether the client's master takes a connection and answers one call (blocking)."""
    if not reachable(*master_address(client.params.master), _PROBE_TIMEOUT_S):
        return False
    return not lost_master(client.store.batch_is_exist([_PROBE_KEY]))
