"""Running the router of ``serve --workers N`` (or ``--worker URL ...``): its endpoint behind
the same connection guard as a single server (TLS, connection caps, head deadline), and the
health checks of its workers, until asked to stop.

Shutdown: new requests are refused (503), the requests in flight are answered, then the
listener closes. Stopping the workers is the caller's (they may not be this process's).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp
from aiohttp import web

from hicache.server.app import Listen
from hicache.server.connections import ConnectionGuard, GuardRules, open_listener
from hicache.server.metrics import ConnectionCounts
from hicache.server.router import RouterApi
from hicache.server.worker_health import HealthRules, WorkerHealth
from hicache.server.workers import Worker

__all__ = ["RouterServer"]

_KEEPALIVE_S = 15.0


class RouterServer:
    """``api`` served at ``listen``; :meth:`serve` runs until :meth:`stop`."""

    def __init__(self, api: RouterApi, listen: Listen, health: HealthRules | None = None) -> None:
        self.api = api
        self.listen = listen
        limits = api.gate.limits
        rules = GuardRules(
            limits.max_connections, limits.max_connections_per_client, limits.header_timeout_s
        )
        tls = listen.tls.context() if listen.tls is not None else None
        self.guard = ConnectionGuard(rules, tls)
        api.registry.register(ConnectionCounts(self.guard, "hicache_router"))
        self.health = WorkerHealth(api.workers, api.tree, self._probe, health or HealthRules())
        api.worker_health = self.health
        self._stop = asyncio.Event()
        self.url: str | None = None  # once listening

    def stop(self) -> None:
        """Begin the shutdown (safe to call more than once, from a signal handler too)."""
        self._stop.set()

    async def serve(self, ready: Callable[[str], None] | None = None) -> None:
        """Listen, check the workers and route until :meth:`stop`; ``ready`` gets the URL."""
        app = self.api.app()
        app.middlewares.insert(0, self.guard.middleware())
        runner = web.AppRunner(app, handle_signals=False, keepalive_timeout=_KEEPALIVE_S)
        await runner.setup()
        watcher = asyncio.create_task(self.health.run())
        listener: asyncio.Server | None = None
        try:
            assert runner.server is not None  # set up above
            listener, self.url = await open_listener(
                runner.server, self.listen.host, self.listen.port, self.guard
            )
            if ready is not None:
                ready(self.url)
            await self._stop.wait()
            self.api.closing = True
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            if listener is not None:
                listener.close()
            await runner.cleanup()  # the requests in flight are answered first

    async def _probe(self, worker: Worker) -> bool:
        """Whether ``worker``'s ``/health`` answers 200 in time."""
        timeout = aiohttp.ClientTimeout(total=self.health.rules.probe_timeout_s)
        try:
            async with self.api.session.get(f"{worker.url}/health", timeout=timeout) as answer:
                return answer.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
