"""The router in one process over fake workers (small aiohttp apps): TLS on its endpoint and to
its workers, workers set aside after repeated failures and brought back, a 503 with
Retry-After while none answers, a request moved off a worker it cannot reach, clients that
stop reading dropped without holding up the others, and a ``/health`` that tells strangers
only its status."""

from __future__ import annotations

import asyncio
import json
import pathlib
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web
from tls_kit import self_signed

from hicache.scheduling.router import RouterConfig
from hicache.server.app import Listen, TlsFiles
from hicache.server.auth import DEFAULT_TENANT, Access, KeyRing
from hicache.server.limits import Limits
from hicache.server.request_body import ServedModel
from hicache.server.router import RouterApi, RouterGate, RouterKind
from hicache.server.router_server import RouterServer
from hicache.server.worker_health import HealthRules
from hicache.server.workers import RemoteWorker

pytest.importorskip("cryptography.x509")

KEY = "sk-router-test-key-1"
FAST = HealthRules(interval_s=0.05, probe_timeout_s=0.2, retire_after=3, readmit_after=2)


@dataclass
class FakeWorker:
    """A worker's two routes: ``/health`` (healthy, or slow by ``health_delay_s``) and
    ``/v1/completions`` (``chunks`` events of ``chunk_bytes`` each, then [DONE])."""

    healthy: bool = True
    health_delay_s: float = 0.0
    chunks: int = 1
    chunk_bytes: int = 16
    endless: bool = False  # stream until the router hangs up (counted in ``dropped``)
    served: int = 0
    dropped: int = 0
    probes: int = 0
    url: str = ""
    runner: web.AppRunner | None = field(default=None, repr=False)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, _: web.Request) -> web.Response:
        self.probes += 1
        await asyncio.sleep(self.health_delay_s)
        return web.json_response({"status": "ok"}, status=200 if self.healthy else 503)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.served += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        event = f"data: {json.dumps({'x': 'y' * self.chunk_bytes})}\n\n".encode()
        try:
            for _ in range(self.chunks):
                await response.write(event)
            while self.endless:
                await response.write(event)
        except ConnectionError:
            self.dropped += 1
            raise
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@asynccontextmanager
async def workers(count: int, tls: TlsFiles | None = None) -> AsyncIterator[list[FakeWorker]]:
    fakes = [FakeWorker() for _ in range(count)]
    for fake in fakes:
        fake.runner = web.AppRunner(fake.app())
        await fake.runner.setup()
        context = tls.context() if tls is not None else None
        site = web.TCPSite(fake.runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        port = fake.runner.addresses[0][1]
        fake.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield fakes
    finally:
        for fake in fakes:
            if fake.runner is not None:
                await fake.runner.cleanup()


@asynccontextmanager
async def routing(
    fakes: list[FakeWorker],
    limits: Limits | None = None,
    tls: TlsFiles | None = None,
    worker_tls: ssl.SSLContext | None = None,
) -> AsyncIterator[RouterServer]:
    access = Access(KeyRing({KEY: DEFAULT_TENANT}))
    gate = RouterGate(access, limits or Limits(), "t" * 32, worker_tls)
    remote = [RemoteWorker(i, fake.url) for i, fake in enumerate(fakes)]
    api = RouterApi(remote, RouterKind.ROUND_ROBIN, ServedModel("m", 1000), RouterConfig(), gate)
    server = RouterServer(api, Listen("127.0.0.1", 0, 5.0, tls), FAST)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.url is not None or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.url is not None, task
    try:
        yield server
    finally:
        server.stop()
        await asyncio.wait_for(task, 30)


def client(server: RouterServer, **options: object) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.AsyncClient(base_url=server.url or "", headers=headers, timeout=10, **options)


BODY = {"prompt": [1, 2, 3], "max_tokens": 1}


async def wait_for(check: object, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_one_slow_health_reply_retires_nobody_and_a_dead_worker_comes_back() -> None:
    async with workers(2) as fakes, routing(fakes) as server:
        alive = server.api.tree
        fakes[1].health_delay_s = 0.5  # one probe past its timeout, then fast again
        await wait_for(lambda: fakes[1].probes >= 2)
        fakes[1].health_delay_s = 0.0
        await asyncio.sleep(0.3)
        assert alive.alive == [0, 1]
        fakes[1].healthy = False  # 503s in a row: set aside
        await wait_for(lambda: alive.alive == [0])
        async with client(server) as http:
            for _ in range(4):
                assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        assert fakes[1].served == 0
        fakes[1].healthy = True  # answers again: back in the rotation
        await wait_for(lambda: alive.alive == [0, 1])
        async with client(server) as http:
            for _ in range(4):
                assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        assert fakes[1].served >= 1


async def test_with_no_worker_answering_the_router_stays_and_says_retry() -> None:
    async with workers(1) as fakes, routing(fakes) as server:
        fakes[0].healthy = False
        await wait_for(lambda: server.api.tree.alive == [])
        async with client(server) as http:
            answer = await http.post("/v1/completions", json=BODY)
            assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
            health = await http.get("/health")
            assert health.status_code == 503
        fakes[0].healthy = True
        await wait_for(lambda: server.api.tree.alive == [0])
        async with client(server) as http:
            assert (await http.post("/v1/completions", json=BODY)).status_code == 200


async def test_a_request_to_an_unreachable_worker_goes_to_another() -> None:
    async with workers(2) as fakes:
        gone = fakes[0]
        assert gone.runner is not None
        await gone.runner.cleanup()  # nothing listens at its address now
        gone.runner = None
        async with routing(fakes) as server:
            server.health.rules = HealthRules(interval_s=60)  # only requests see the failures
            async with client(server) as http:
                answers = [await http.post("/v1/completions", json=BODY) for _ in range(4)]
            assert [a.status_code for a in answers] == [200] * 4
            assert fakes[1].served == 4


async def test_health_tells_strangers_only_its_status() -> None:
    async with workers(2) as fakes, routing(fakes) as server:
        async with httpx.AsyncClient(base_url=server.url or "") as stranger:
            assert (await stranger.get("/health")).json() == {"status": "ok"}
        async with client(server) as http:
            shown = (await http.get("/health")).json()
        assert [w["index"] for w in shown["workers"]] == [0, 1]
        text = json.dumps(shown)
        assert "127.0.0.1" not in text and "pid" not in text and "url" not in text


async def test_the_router_serves_tls_and_checks_its_workers_certificates(
    tmp_path: pathlib.Path,
) -> None:
    tls = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=tls.certfile)
    async with workers(1, tls) as fakes:
        async with routing(fakes, tls=tls, worker_tls=trust) as server:
            assert (server.url or "").startswith("https://")
            async with client(server, verify=trust) as http:
                assert (await http.post("/v1/completions", json=BODY)).status_code == 200
            plain = (server.url or "").replace("https://", "http://")
            async with httpx.AsyncClient() as http:
                with pytest.raises(httpx.HTTPError):
                    await http.get(f"{plain}/health")
        # The same worker, with the system's CAs only: its certificate is refused.
        async with routing(fakes, tls=tls) as server:
            server.health.rules = HealthRules(interval_s=60)
            async with client(server, verify=trust) as http:
                answer = await http.post("/v1/completions", json=BODY)
            assert answer.status_code == 503 and fakes[0].served == 1


async def test_a_client_that_stops_reading_is_dropped_and_others_are_served() -> None:
    limits = Limits(write_timeout_s=0.5)
    async with workers(2) as fakes, routing(fakes, limits) as server:
        fakes[0].endless, fakes[0].chunk_bytes = True, 65536  # worker 0 streams until dropped
        host, port = (server.url or "").removeprefix("http://").split(":")
        payload = json.dumps(BODY)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                f"{payload}")  # fmt: skip
        hostile = []
        for _ in range(8):  # streams never read, each on worker 0 (round robin: 0 then 1)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(head.encode())
            hostile.append((reader, writer))
            async with client(server) as http:  # worker 1's turn: a well-behaved caller
                started = asyncio.get_running_loop().time()
                assert (await http.post("/v1/completions", json=BODY)).status_code == 200
                assert asyncio.get_running_loop().time() - started < 1.0
        await wait_for(lambda: fakes[0].dropped == 8, seconds=20)  # each hostile stream cut
        await wait_for(lambda: server.guard.open == 0, seconds=5)
        for _, writer in hostile:
            writer.close()


async def test_connections_are_counted_before_tls_and_capped_per_client(
    tmp_path: pathlib.Path,
) -> None:
    tls = self_signed(tmp_path)
    limits = Limits(max_connections=8, max_connections_per_client=3, header_timeout_s=0.5)
    async with workers(1) as fakes, routing(fakes, limits, tls=tls) as server:
        host, port = (server.url or "").removeprefix("https://").split(":")
        silent = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
        await wait_for(lambda: server.guard.refused == 1)  # no handshake yet, counted anyway
        assert server.guard.open == 3
        await wait_for(lambda: server.guard.timed_out == 3)  # no handshake in time
        assert server.guard.open == 0
        for _, writer in silent:
            writer.close()
