"""Connections of the HTTP servers (a single server and the router): a cap on how many are
open, a cap per client address, TLS, and a deadline for a connection's first request.

aiohttp reads a request head as slowly as the client sends it and keeps any number of
connections open, so a client that opens many and never finishes a head (or a TLS handshake)
would hold them all. :class:`ConnectionGuard` sees each connection at accept, before any TLS
handshake: past ``max_connections`` in all, or ``per_client`` from one address, it is closed at
once (``refused``). With TLS the guard runs the handshake itself (``loop.start_tls``) within
``header_timeout_s``, and a connection whose first request head has not arrived by then,
handshake included, is closed (``timed_out``). An idle keep-alive connection is aiohttp's to
close (its keep-alive timeout); a slow body is the handler's (``body_timeout_s``, a 408).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

__all__ = ["ConnectionGuard", "GuardRules", "open_listener"]


@dataclass(frozen=True, slots=True)
class GuardRules:
    """How many connections may be open in all and from one client address, and how long a
    connection has to send its first request head (its TLS handshake included)."""

    max_connections: int = 1024
    per_client: int | None = 256  # None: no cap per address (a worker behind its router)
    header_timeout_s: float = 10.0


class ConnectionGuard:
    """Counts open connections and closes the ones over a cap or too slow to ask."""

    def __init__(self, rules: GuardRules, tls: ssl.SSLContext | None = None) -> None:
        self.rules = rules
        self.tls = tls
        self.open = 0
        self.refused = 0  # closed at once: a cap was reached
        self.timed_out = 0  # closed: no request head (or no TLS handshake) in time
        self.by_client: Counter[str] = Counter()
        self._asked: set[Any] = set()  # transports whose first request head arrived

    @property
    def max_connections(self) -> int:
        return self.rules.max_connections

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` (given no ``ssl``: the guard runs
        TLS) around aiohttp's ``make``."""
        return lambda: _Guarded(make(), self)

    def asked(self, transport: Any) -> None:
        """A request head arrived on ``transport`` (called for every request)."""
        self._asked.add(transport)

    def middleware(self) -> Middleware:
        """An aiohttp middleware telling the guard that a request head arrived."""

        @web.middleware
        async def seen(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.asked(request.transport)
            return await handler(request)

        return seen

    def _admit(self, client: str) -> bool:
        rules = self.rules
        over_client = rules.per_client is not None and self.by_client[client] >= rules.per_client
        if self.open >= rules.max_connections or over_client:
            self.refused += 1
            return False
        self.open += 1
        self.by_client[client] += 1
        return True

    def _release(self, client: str) -> None:
        self.open -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]


async def open_listener(
    make: Callable[[], asyncio.Protocol], host: str, port: int, guard: ConnectionGuard
) -> tuple[asyncio.Server, str]:
    """Listen on ``host:port`` for aiohttp's protocol ``make`` behind ``guard``; the server
    and its URL (``https://`` when the guard runs TLS)."""
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(guard.factory(make), host, port)
    bound_host, bound_port = listener.sockets[0].getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return listener, f"{'https' if guard.tls else 'http'}://{shown}:{bound_port}"


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol, as the guard lets it see a connection: counted from accept; with
    TLS, aiohttp sees the connection once its handshake is done."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._raw: Any = None  # the accepted socket's transport (counted while set)
        self._app: Any = None  # what aiohttp reads and writes (the TLS one, with TLS)
        self._client = ""
        self._pending: list[bytes] | None = None  # TLS data that came before aiohttp saw it
        self._timer: asyncio.TimerHandle | None = None
        self._upgrade: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._guard._admit(client):
            transport.abort()  # type: ignore[attr-defined]
            return
        self._raw, self._client = transport, client
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.rules.header_timeout_s, self._deadline)
        if self._guard.tls is None:
            self._app = transport
            self._inner.connection_made(transport)
            return
        self._pending = []
        self._upgrade = loop.create_task(self._handshake(transport))

    async def _handshake(self, raw: Any) -> None:
        loop, guard = asyncio.get_running_loop(), self._guard
        assert guard.tls is not None
        try:
            app = await loop.start_tls(
                raw, self, guard.tls, server_side=True,
                ssl_handshake_timeout=guard.rules.header_timeout_s,
            )  # fmt: skip
        except (OSError, ssl.SSLError, ConnectionError, TimeoutError):
            self._closed(None)  # a failed or timed-out handshake: aiohttp never saw it
            return
        if app is None or self._raw is None:
            self._closed(None)
            return
        self._app = app
        self._inner.connection_made(app)
        pending, self._pending = self._pending or [], None
        for data in pending:
            self._inner.data_received(data)

    def _deadline(self) -> None:
        if self._raw is not None and self._app not in self._guard._asked:
            self._guard.timed_out += 1
            self._raw.abort()
            if self._pending is not None:  # mid-handshake: the TLS layer tells nobody
                self._closed(None)

    def _closed(self, exc: Exception | None) -> None:
        """The connection ended (once, whichever layer tells first)."""
        if self._raw is None:
            return
        self._raw = None
        self._guard._release(self._client)
        self._guard._asked.discard(self._app)
        if self._timer is not None:
            self._timer.cancel()
        if self._app is not None and self._pending is None:
            self._inner.connection_lost(exc)  # aiohttp saw it: it cleans up its handler

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(exc)

    def data_received(self, data: bytes) -> None:
        if self._pending is not None:
            self._pending.append(data)  # decrypted before aiohttp had its transport
            return
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._pending is not None:
            return None
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        if self._pending is None and self._app is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._pending is None and self._app is not None:
            self._inner.resume_writing()
