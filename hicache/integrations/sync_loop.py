"""An event loop in a thread of its own, for engines that call storage from plain threads.

SGLang calls its storage backend synchronously from its prefetch and backup threads; hicache
backends are coroutines. Each engine call becomes one coroutine run here, batched, and the
calling thread waits for its result (or a timeout, after which the coroutine is cancelled).

The thread is a daemon so that an engine which never calls :meth:`SyncLoop.close` cannot keep
its process from exiting; it is not silent: every error comes back to the caller of that call,
and an ``atexit`` hook closes whatever is still open, so writes in flight finish first.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from hicache.errors import BackendClosedError, BackendUnavailableError

__all__ = ["SyncLoop"]

T = TypeVar("T")
log = logging.getLogger("hicache.integrations")
_OPEN: weakref.WeakSet[SyncLoop] = weakref.WeakSet()


class SyncLoop:
    """Runs coroutines on its own loop for callers in other threads."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._closed = False
        self._on_close: list[Callable[[], Awaitable[Any]]] = []
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        _OPEN.add(self)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        self._loop.run_forever()
        self._loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        """The coroutine's result; its exception raised here; a timeout cancels it.

        A timeout raises :class:`BackendUnavailableError`: the engine counts a miss or a failed
        write, and the cancelled coroutine leaves no half-visible object (backends write
        atomically).
        """
        return self.wait(self.submit(coro), timeout_s)

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start the coroutine on the loop and return at once; :meth:`wait` for its result."""
        if self._closed or threading.current_thread() is self._thread:
            close = getattr(coro, "close", None)
            if close is not None:
                close()  # never awaited: closed so Python does not warn about it
            if self._closed:
                raise BackendClosedError("the storage adapter is closed")
            raise RuntimeError("SyncLoop called from its own loop thread (would deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def wait(self, future: concurrent.futures.Future[T], timeout_s: float | None = None) -> T:
        """The result of a :meth:`submit`; a timeout cancels the coroutine."""
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BackendUnavailableError(f"storage call took over {timeout_s} s") from None

    def on_close(self, closer: Callable[[], Awaitable[Any]]) -> None:
        """Run ``closer()`` on the loop when it closes (a backend's ``close``)."""
        self._on_close.append(closer)

    def close(self, timeout_s: float = 30.0) -> None:
        """Run the close hooks, stop the loop and join the thread. Idempotent."""
        if self._closed:
            return
        try:
            for closer in reversed(self._on_close):
                try:  # one failing hook (a backend that will not close) must not skip the rest
                    self.run(closer(), timeout_s)
                except Exception:
                    log.exception("hicache: a close hook of %s failed", self._thread.name)
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            _OPEN.discard(self)


@atexit.register
def _close_open_loops() -> None:
    for loop in list(_OPEN):
        with contextlib.suppress(Exception):  # at exit nothing is left to report an error to
            loop.close()
