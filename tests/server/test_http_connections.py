"""Slow and greedy clients: a connection cap, a deadline for a request head, and one for a
body, against a live server over raw sockets."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
from http_kit import serving
from prometheus_client.parser import text_string_to_metric_families

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
    async with serving(None, limits=Limits(max_connections=4, header_timeout_s=0.5)) as server:
        slow = [await _open(server, PARTIAL_HEAD) for _ in range(4)]
        extra, _ = await _open(server, PARTIAL_HEAD)
        assert await _closed_within(extra, 0.3)  # over the cap: closed at once
        assert all([await _closed_within(r, 2.0) for r, _ in slow])  # no head in 0.5 s
        assert (server.guard.refused, server.guard.timed_out) == (1, 4)
        async with httpx.AsyncClient(base_url=server.url or "") as client:
            assert (await client.get("/health")).status_code == 200  # room again
            text = (await client.get("/metrics")).text
        counts = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert counts["hicache_http_connections_refused_total"] == 1
        assert counts["hicache_http_connections_timed_out_total"] == 4
        for _, writer in slow:
            writer.close()


async def test_a_body_that_does_not_arrive_is_a_408() -> None:
    async with serving(None, limits=Limits(body_timeout_s=0.3)) as server:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\"")  # fmt: skip
        reader, writer = await _open(server, head)
        answer = await asyncio.wait_for(reader.read(4096), 5.0)
        assert answer.startswith(b"HTTP/1.1 408")
        writer.close()
        async with httpx.AsyncClient(base_url=server.url or "") as client:
            body = {"prompt": [1, 2], "max_tokens": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_two_hundred_slow_heads_leave_health_and_requests_served() -> None:
    async with serving(None) as server:
        slow = [await _open(server, PARTIAL_HEAD) for _ in range(200)]
        async with httpx.AsyncClient(base_url=server.url or "", timeout=5.0) as client:
            started = asyncio.get_running_loop().time()
            assert (await client.get("/health")).status_code == 200
            assert asyncio.get_running_loop().time() - started < 1.0
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        for _, writer in slow:
            writer.close()


async def test_a_stream_whose_client_stops_reading_is_dropped() -> None:
    async with serving(None, device_tokens=4096, limits=Limits(write_timeout_s=0.5)) as server:
        host, port = (server.url or "").removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once: unread
        sock.connect((host, int(port)))
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        # Small buffers on the server's side of the connection too, so that an unread stream
        # blocks its writes after a few chunks (loopback buffers hold megabytes otherwise).
        for _ in range(200):
            if server.guard._asked:
                break
            await asyncio.sleep(0.01)
        (transport,) = server.guard._asked
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        engine = server.setup.engine
        for _ in range(600):  # the request ends long before its 3,000 tokens
            if engine.records and server.source.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        record = engine.records[-1]
        assert server.source.in_flight == 0 and record.error is not None
        assert "cancelled" in record.error and record.output_tokens < 3000
        for _ in range(100):  # and its connection is gone: it holds no slot
            if server.guard.open == 0:
                break
            await asyncio.sleep(0.05)
        assert server.guard.open == 0
        sock.close()
