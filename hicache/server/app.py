"""Running the HTTP endpoint: the engine's loop and the aiohttp server on one event loop, until
asked to stop; then a drain.

Shutdown order: new requests are refused (503), the engine finishes every request it has
(queued ones included) and ends its loop, L3 writes still queued get ``drain_s`` to land, the
server closes its connections once the last answer is written, and the cache closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from hicache.errors import ConfigError
from hicache.server.admin import AdminApi
from hicache.server.api import CompletionsApi
from hicache.server.auth import Access
from hicache.server.connections import ConnectionGuard, GuardRules, open_listener
from hicache.server.limits import Limits
from hicache.server.metrics import ServingMetrics
from hicache.server.request_body import ServedModel
from hicache.serving.online import OnlineSource
from hicache.serving.setup import ServingSetup

__all__ = ["GuardedServer", "HttpServer", "Listen", "TlsFiles"]

logger = logging.getLogger(__name__)
_KEEPALIVE_S = 15.0


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A PEM certificate chain and its private key: the server answers HTTPS only."""

    certfile: str
    keyfile: str

    def context(self) -> ssl.SSLContext:
        """A server context (TLS 1.2 or newer); ConfigError when the files do not load."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TLS files {self.certfile}, {self.keyfile}: {exc}") from None
        return context


@dataclass(frozen=True, slots=True)
class Listen:
    """Where to listen, how (TLS files, or plain HTTP), and how long shutdown may wait for L3
    writes."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the bound one is reported)
    drain_s: float = 30.0
    tls: TlsFiles | None = None


class GuardedServer:
    """What the single server and the router share: an aiohttp app behind a
    :class:`ConnectionGuard` (TLS when ``listen`` has files), listening at ``listen`` until
    :meth:`stop`."""

    def __init__(self, listen: Listen, rules: GuardRules) -> None:
        self.listen = listen
        tls = listen.tls.context() if listen.tls is not None else None
        self.guard = ConnectionGuard(rules, tls)
        self._stop = asyncio.Event()
        self.url: str | None = None  # once listening

    def stop(self) -> None:
        """Begin the shutdown (safe to call more than once, from a signal handler too)."""
        self._stop.set()

    async def _runner(self, app: web.Application) -> web.AppRunner:
        """``app`` behind the guard, set up (not yet listening)."""
        app.middlewares.insert(0, self.guard.middleware())
        # An idle keep-alive connection is closed after a while, so idle clients hold nothing.
        runner = web.AppRunner(app, handle_signals=False, keepalive_timeout=_KEEPALIVE_S)
        await runner.setup()
        return runner

    async def _listen(
        self, runner: web.AppRunner, ready: Callable[[str], None] | None
    ) -> asyncio.Server:
        """Listen at ``listen`` through the guard; ``ready`` gets the URL."""
        assert runner.server is not None  # set up by _runner
        host, port = self.listen.host, self.listen.port
        listener, self.url = await open_listener(runner.server, host, port, self.guard)
        if ready is not None:
            ready(self.url)
        return listener


class HttpServer(GuardedServer):
    """One engine behind the OpenAI-compatible API; :meth:`serve` runs until :meth:`stop`."""

    def __init__(
        self,
        setup: ServingSetup,
        model: ServedModel,
        listen: Listen,
        access: Access | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.setup = setup
        self.access = access or Access()
        self.source = OnlineSource(setup.engine.now)
        cache_metrics = setup.cache.metrics if setup.cache is not None else None
        self.metrics = ServingMetrics(cache_metrics)
        self.api = CompletionsApi(
            setup.engine, self.source, model, self.metrics, self.access, limits
        )
        limits = limits or Limits()
        # A worker behind its router sees every request come from the router's address.
        per_client = None if self.access.internal_token else limits.max_connections_per_client
        rules = GuardRules(limits.max_connections, per_client, limits.header_timeout_s)
        super().__init__(listen, rules)
        self.metrics.watch_connections(self.guard)
        self.admin = AdminApi(setup.engine, model, listen.drain_s, self.access.l3_allow)

    async def serve(self, ready: Callable[[str], None] | None = None) -> None:
        """Listen, serve until :meth:`stop`, drain; ``ready`` gets the URL once listening."""
        app = self.api.app()
        if self.access.admin_key is not None:  # the admin plane is off without its key
            self.admin.add_routes(app)
        runner = await self._runner(app)
        engine = asyncio.create_task(self.setup.engine.run(self.source, wake=self.source.wake))
        listener: asyncio.Server | None = None
        try:
            listener = await self._listen(runner, ready)
            stopping = asyncio.create_task(self._stop.wait())
            await asyncio.wait({engine, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            self.source.close()
            await engine  # every request it had is answered (or failed) by now
            await self._drain_l3()
        finally:
            self.source.close()
            if not engine.done():
                engine.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await engine
            if listener is not None:
                listener.close()  # no new connections
            await runner.cleanup()  # waits for the handlers writing the last answers
            await self.setup.close(self.listen.drain_s)

    async def _drain_l3(self) -> None:
        cache = self.setup.cache
        if cache is None:
            return
        try:
            await cache.quiesce(self.listen.drain_s)
        except TimeoutError:
            queued = cache.l3_queued_pages
            logger.warning("shutdown: %d pages still queued for L3 after %.0f s", queued,
                           self.listen.drain_s)  # fmt: skip
