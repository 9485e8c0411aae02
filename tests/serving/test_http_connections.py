"""Slow and greedy clients: a connection cap, a deadline for a request head, and one for a
body, against a live server over raw sockets."""

from __future__ import annotations

import asyncio

import httpx
from test_http_api import start, stop

from hicache.server.app import HttpServer
from hicache.server.limits import Limits

PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"


async def _open(
    server: HttpServer, data: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = (server.url or "").removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    return reader, writer


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False


async def test_slow_heads_are_closed_and_the_cap_refuses_more() -> None:
    server = await start(None, limits=Limits(max_connections=4, header_timeout_s=0.5))
    try:
        slow = [await _open(server, PARTIAL_HEAD) for _ in range(4)]
        extra, _ = await _open(server, PARTIAL_HEAD)
        assert await _closed_within(extra, 0.3)  # over the cap: closed at once
        assert all([await _closed_within(r, 2.0) for r, _ in slow])  # no head in 0.5 s
        assert (server.guard.refused, server.guard.timed_out) == (1, 4)
        async with httpx.AsyncClient(base_url=server.url or "") as client:
            assert (await client.get("/health")).status_code == 200  # room again
        for _, writer in slow:
            writer.close()
    finally:
        await stop(server)


async def test_a_body_that_does_not_arrive_is_a_408() -> None:
    server = await start(None, limits=Limits(body_timeout_s=0.3))
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\"")  # fmt: skip
        reader, writer = await _open(server, head)
        answer = await asyncio.wait_for(reader.read(4096), 5.0)
        assert answer.startswith(b"HTTP/1.1 408")
        writer.close()
        async with httpx.AsyncClient(base_url=server.url or "") as client:
            body = {"prompt": [1, 2], "max_tokens": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    finally:
        await stop(server)


async def test_two_hundred_slow_heads_leave_health_and_requests_served() -> None:
    server = await start(None)
    try:
        slow = [await _open(server, PARTIAL_HEAD) for _ in range(200)]
        async with httpx.AsyncClient(base_url=server.url or "", timeout=5.0) as client:
            started = asyncio.get_running_loop().time()
            assert (await client.get("/health")).status_code == 200
            assert asyncio.get_running_loop().time() - started < 1.0
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        for _, writer in slow:
            writer.close()
    finally:
        await stop(server)
