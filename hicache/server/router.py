"""The router process of ``serve --workers N``: one OpenAI-compatible endpoint in front of N
engine workers, each request sent whole to one of them.

``cache_aware`` sends a request to the worker whose approximate prefix tree matches the prefix of
its prompt worth most (device tokens, and host tokens at the config's ``host_hit_weight``)
unless that worker carries too much more load (:class:`~hicache.scheduling.router.
CacheAwareRouter`); ``round_robin`` takes turns. The worker's answer (JSON or the event stream)
is passed through as it comes. Which workers take requests is :class:`~hicache.server.
worker_health.WorkerHealth`'s to say: a connection the router cannot make counts as a failure
and the request goes to another worker (nothing was sent); a worker that fails mid-answer
gives that request a 502 naming its index (never its address). With no worker healthy a
request is a 503 with Retry-After. The router keeps the single server's limits: a body
deadline (408), a write deadline per chunk (a client that stops reading is dropped, and so is
its worker request), per-caller limits, and the connection caps of
:mod:`~hicache.server.connections`. ``/metrics`` holds the router's own counters and every
worker's metrics with a ``worker`` label; ``/health`` answers its status to anyone, and which
workers are healthy only to a caller with a valid key.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import json
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from hicache.errors import InvalidArgumentError
from hicache.keys import RadixKey
from hicache.scheduling.router import CacheAwareRouter, RouterConfig
from hicache.server.answers import error_response, models_body
from hicache.server.auth import (
    TENANT_HEADER,
    Access,
    cache_namespace,
    current_tenant,
    key_of,
    openai_app,
)
from hicache.server.chat import parse_chat
from hicache.server.limits import CallerLimiter, Limits, caller_of, check_priority
from hicache.server.request_body import (
    ApiError,
    ServedModel,
    parse_body,
    parse_completion,
    read_body,
)
from hicache.server.worker_health import WorkerHealth
from hicache.server.workers import Worker

__all__ = ["RouterApi", "RouterGate", "RouterKind"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterGate:
    """What the router checks before forwarding (keys, tenants, per-caller limits), and the
    internal token its workers take from it alone."""

    access: Access = field(default_factory=Access)
    limits: Limits = field(default_factory=Limits)
    internal_token: str | None = None
    worker_tls: ssl.SSLContext | None = None  # checks https:// workers' certificates


class RouterKind(enum.Enum):
    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"


class RouterApi:
    """Routes of the router process over its workers."""

    def __init__(
        self,
        workers: Sequence[Worker],
        kind: RouterKind,
        model: ServedModel,
        router: RouterConfig,
        gate: RouterGate | None = None,
    ) -> None:
        self.gate = gate or RouterGate()
        self.started = int(time.time())
        self.limiter = CallerLimiter(self.gate.limits)
        self.workers = workers
        self.kind = kind
        self.model = model
        self.tree = CacheAwareRouter(len(workers), router)
        self._turns = itertools.cycle(range(len(workers)))
        self.closing = False
        self.worker_health: WorkerHealth | None = None  # set by whoever runs the checks
        self._session: aiohttp.ClientSession | None = None
        self._worker_texts: dict[int, str | None] = {}  # fetched at each scrape
        self._register_metrics()

    def app(self) -> web.Application:
        app = openai_app(
            self.gate.access,
            self.gate.limits.max_body_bytes,
            completions=self.completions,
            chat=self.completions,  # one handler: it tells the two by the path
            models=self.models,
            health=self.health,
            metrics=self.metrics,
        )
        app.on_cleanup.append(self._close_session)
        return app

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on the server's loop, on first use
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
            # No pool limit: each upstream connection serves one client connection, which the
            # router's own connection cap bounds; a pool limit would queue every tenant behind
            # one that holds streams open.
            tls = self.gate.worker_tls if self.gate.worker_tls is not None else True
            connector = aiohttp.TCPConnector(limit=0, ssl=tls)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def _close_session(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    # ----- routes ---------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        alive = self.tree.alive
        ok = bool(alive) and not self.closing
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable"}
        key = key_of(request)
        if key is not None and self.gate.access.keys.tenant_of(key) is not None:
            # Which workers are healthy, for a caller with a key; their addresses and pids are
            # the operator's (in the router's log), never in an answer.
            workers = [{"index": w.index, "alive": w.index in alive} for w in self.workers]
            body |= {"model": self.model.name, "router": self.kind.value, "workers": workers}
        response = web.json_response(body, status=200 if ok else 503)
        if not ok:
            response.headers["Retry-After"] = "1"
        return response

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(models_body(self.model.name, self.started))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        caller = caller_of(request)
        try:
            self.limiter.take(caller)
        except ApiError as exc:
            return error_response(exc)
        try:
            return await self._route(request)
        finally:
            self.limiter.release(caller)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await read_body(request, self.gate.limits.body_timeout_s)
            if self.closing:
                raise ApiError("the server is shutting down and takes no new requests", None, 503)
            chat = request.path == "/v1/chat/completions"
            # The prompt's tokens, to route by; the worker checks the body again, fully.
            parse = parse_chat if chat else parse_completion
            args = await parse_body(raw, functools.partial(parse, model=self.model))
            tenant = current_tenant()
            # The router holds the keys, so it caps priority; its workers trust its token.
            check_priority(args.priority, self.gate.access, tenant)
            share = self.gate.access.share_cache
            # Routed by the prefix in the request's own namespace: tenants share no pages.
            key = RadixKey(args.prompt, cache_namespace(tenant, args.cache_salt, share))
        except ApiError as exc:
            return error_response(exc)
        tried: set[int] = set()
        while True:
            try:
                worker = self._pick(key, tried)
            except ApiError as exc:
                return error_response(exc)
            try:
                return await self._forward(request, worker, raw, tenant)
            except aiohttp.ClientConnectorError as exc:  # nothing was sent: another may take it
                tried.add(worker)
                self._unreachable(worker, exc)
            finally:
                self.tree.complete(worker, float(len(args.prompt)))

    async def metrics(self, _: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._alive_gauge.set(len(self.tree.alive))
        self._worker_texts = {w: await self._worker_metrics(w) for w in self.tree.alive}
        response = web.Response(body=generate_latest(self.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    def _register_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self._requests = Counter(
            "hicache_router_requests", "requests sent to each worker, by outcome",
            ["worker", "outcome"], registry=self.registry,
        )  # fmt: skip
        self._alive_gauge = Gauge(
            "hicache_router_workers_alive", "workers requests may go to", registry=self.registry
        )
        self.registry.register(_WorkerMetrics(lambda: self._worker_texts))

    # ----- helpers --------------------------------------------------------------------------
    def _pick(self, key: RadixKey, tried: set[int]) -> int:
        alive = [w for w in self.tree.alive if w not in tried]
        if not alive:
            raise ApiError("no worker is available: retry shortly", None, 503,
                           "no_worker_available", retry_after_s=1.0)  # fmt: skip
        if self.kind is RouterKind.ROUND_ROBIN:
            while (worker := next(self._turns)) not in alive:
                pass
            return worker
        if tried:  # a retry after an unreachable worker: any other healthy one will do
            return alive[0]
        try:
            return self.tree.route(key)
        except InvalidArgumentError as exc:
            raise ApiError(str(exc), None, 503, retry_after_s=1.0) from None

    def _unreachable(self, worker: int, exc: Exception) -> None:
        self._requests.labels(str(worker), "unreachable").inc()
        logger.warning("worker %d could not be reached: %r", worker, exc)
        if self.worker_health is not None:
            self.worker_health.failed(worker, "could not be reached")
        else:
            self.tree.retire(worker)

    async def _forward(
        self, request: web.Request, worker: int, raw: bytes, tenant: str | None
    ) -> web.StreamResponse:
        url = f"{self.workers[worker].url}{request.path}"
        headers = {"Content-Type": "application/json", **self._worker_headers()}
        if tenant is not None:
            headers[TENANT_HEADER] = tenant
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(url, data=raw, headers=headers) as answer:
                content_type = answer.headers.get("Content-Type", "application/json")
                response = web.StreamResponse(status=answer.status)
                response.headers["Content-Type"] = content_type
                response.headers["X-Hicache-Worker"] = str(worker)
                if "Retry-After" in answer.headers:
                    response.headers["Retry-After"] = answer.headers["Retry-After"]
                await response.prepare(request)
                if not await self._relay(request, answer, response):
                    return response  # the client stopped reading: both sides dropped
                self._requests.labels(str(worker), "answered").inc()
                return response
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return await self._worker_failed(request, response, worker, exc)

    async def _relay(
        self, request: web.Request, answer: aiohttp.ClientResponse, response: web.StreamResponse
    ) -> bool:
        """Pass ``answer``'s body on as it comes; False when the client took no chunk within
        the write timeout or hung up (its connection is closed then)."""
        timeout = self.gate.limits.write_timeout_s
        try:
            async for chunk in answer.content.iter_any():
                await asyncio.wait_for(response.write(chunk), timeout)
            await response.write_eof()
        except (ConnectionError, TimeoutError):
            if request.transport is not None:
                # abort, not close: close would wait to send what the client is not reading
                request.transport.abort()
            return False
        return True

    async def _worker_failed(
        self,
        request: web.Request,
        response: web.StreamResponse | None,
        worker: int,
        exc: Exception,
    ) -> web.StreamResponse:
        self._requests.labels(str(worker), "failed").inc()
        if self.worker_health is not None:
            self.worker_health.failed(worker, "failed while serving a request")
        # The cause names the worker's internal address: logged here, never sent to a client.
        logger.warning("worker %d failed while serving a request: %r", worker, exc)
        error = ApiError(f"worker {worker} failed while serving this request", None, 502)
        if response is None or not response.prepared:
            return web.json_response(error.body(), status=502)
        await response.write(f"data: {json.dumps(error.body())}\n\n".encode())
        await response.write_eof()
        return response

    async def _worker_metrics(self, worker: int) -> str | None:
        try:
            url, headers = f"{self.workers[worker].url}/metrics", self._worker_headers()
            async with self.session.get(url, headers=headers) as answer:
                return await answer.text() if answer.status == 200 else None
        except aiohttp.ClientError:
            return None

    def _worker_headers(self) -> dict[str, str]:
        token = self.gate.internal_token
        return {"Authorization": f"Bearer {token}"} if token is not None else {}


class _WorkerMetrics:
    """Every live worker's metric families, merged, each sample labelled with its worker."""

    def __init__(self, texts: Callable[[], dict[int, str | None]]) -> None:
        self._texts = texts

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        merged: dict[str, Any] = {}
        for worker, text in sorted(self._texts().items()):
            for family in text_string_to_metric_families(text or ""):
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "worker": str(worker)}
                    into.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield from merged.values()
