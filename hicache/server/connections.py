"""Connections of the HTTP server: a cap on how many are open, and a deadline for a request.

aiohttp reads a request head as slowly as the client sends it and keeps any number of
connections open, so a client that opens many and never finishes a head would hold them all.
:class:`ConnectionGuard` wraps aiohttp's protocol: past ``max_connections`` a new connection
is closed at once, and a connection whose first request head has not arrived within
``header_timeout_s`` is closed (``refused`` and ``timed_out`` count them). An idle keep-alive
connection is aiohttp's to close (its keep-alive timeout); a slow body is the handler's
(``body_timeout_s``, a 408).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["ConnectionGuard"]


class ConnectionGuard:
    """Counts open connections and closes the ones over the cap or too slow to ask."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0  # closed at once: the cap was reached
        self.timed_out = 0  # closed: no request head in time
        self._asked: set[Any] = set()  # transports whose first request head arrived

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` around aiohttp's ``make``."""
        return lambda: _Guarded(make(), self)

    def asked(self, transport: Any) -> None:
        """A request head arrived on ``transport`` (called for every request)."""
        self._asked.add(transport)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol, as the guard lets it see a connection."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._transport: Any = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if guard.open >= guard.max_connections:
            guard.refused += 1
            transport.abort()  # type: ignore[attr-defined]
            return
        guard.open += 1
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(guard.header_timeout_s, self._deadline)
        self._inner.connection_made(transport)

    def _deadline(self) -> None:
        if self._transport is not None and self._transport not in self._guard._asked:
            self._guard.timed_out += 1
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is None:
            return  # refused: aiohttp never saw it
        self._guard.open -= 1
        self._guard._asked.discard(self._transport)
        if self._timer is not None:
            self._timer.cancel()
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()
