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

from hicache.server.app import GuardedServer, Listen
from hicache.server.connections import GuardRules
from hicache.server.metrics import ConnectionCounts
from hicache.server.router import RouterApi
from hicache.server.worker_health import HealthRules, WorkerHealth
from hicache.server.workers import Worker

__all__ = ["RouterServer"]


class RouterServer(GuardedServer):
    """``api`` served at ``listen``; :meth:`serve` runs until :meth:`stop`."""

    def __init__(self, api: RouterApi, listen: Listen, health: HealthRules | None = None) -> None:
        limits = api.gate.limits
        rules = GuardRules(
            limits.max_connections, limits.max_connections_per_client, limits.header_timeout_s
        )
        super().__init__(listen, rules)
        self.api = api
        api.registry.register(ConnectionCounts(self.guard, "hicache_router"))
        self.health = WorkerHealth(api.workers, api.tree, self._probe, health or HealthRules())
        api.worker_health = self.health

    async def serve(self, ready: Callable[[str], None] | None = None) -> None:
        """Listen, check the workers and route until :meth:`stop`; ``ready`` gets the URL."""
        runner = await self._runner(self.api.app())
        watcher = asyncio.create_task(self.health.run())
        listener: asyncio.Server | None = None
        try:
            listener = await self._listen(runner, ready)
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
