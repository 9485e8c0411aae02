"""hicache's own RESP connections for page GETs and SETs: values received into the caller's
buffers, segments sent as they are, a malformed or cut reply a failure (never wrong bytes), a
cancelled read that stops touching the buffers, and a cluster's redirections followed."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.exceptions import InvalidResponse, ResponseError
from redis_kit import open_redis

from hicache.backends.base import MISS
from hicache.backends.redis import RedisBackend
from hicache.backends.redis.pages import READ_WINDOW
from hicache.backends.redis.resp import ReplyReader, command, store_frame
from hicache.tools.services.redis import RedisCluster, RedisServer


# ----- the wire, over a socket pair --------------------------------------------------------------
@pytest.fixture
def wire() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    yield ours, theirs
    ours.close()
    theirs.close()


def _send_later(sock: socket.socket, data: bytes, pieces: int = 7) -> threading.Thread:
    """Send ``data`` from a thread, cut into ``pieces`` writes (replies arrive in bits)."""

    def send() -> None:
        step = max(1, -(-len(data) // pieces))
        for at in range(0, len(data), step):
            sock.sendall(data[at : at + step])

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert command(b"GET", b"k1") == b"*2\r\n$3\r\nGET\r\n$2\r\nk1\r\n"
    head, tail = store_frame(b"k", 5, ttl=60, only_new=True)
    assert head + b"hello" + tail == command(b"SET", b"k", b"hello", b"EX", b"60", b"NX")
    head, tail = store_frame(b"k", 0, ttl=0, only_new=False)
    assert head + tail == command(b"SET", b"k", b"")


@pytest.mark.asyncio
async def test_values_land_in_the_callers_segments_in_order(wire: Any) -> None:
    ours, theirs = wire
    big = bytes(range(256)) * 4096  # 1 MiB
    stream = b"$%d\r\n%s\r\n$-1\r\n-ERR no\r\n$3\r\nabc\r\n+OK\r\n:7\r\n" % (len(big), big)
    sender = _send_later(theirs, stream)
    reader = ReplyReader(ours)
    first, second = bytearray(300_000), bytearray(len(big) - 300_000 + 10)
    assert await reader.value_into([memoryview(first), memoryview(second)]) == len(big)
    assert bytes(first) + bytes(second[: len(big) - 300_000]) == big
    assert second[len(big) - 300_000 :] == bytes(10)  # nothing past the value
    assert reader.staged < len(big) // 2  # most of it went straight into the buffers
    assert await reader.value_into([memoryview(bytearray(4))]) is None
    error = await reader.value_into([memoryview(bytearray(4))])
    assert isinstance(error, ResponseError) and str(error) == "ERR no"
    small = bytearray(2)  # too small: the size is reported, nothing copied, the stream in step
    assert await reader.value_into([memoryview(small)]) == 3 and small == bytes(2)
    assert await reader.reply() == b"OK"
    assert await reader.reply() == 7
    sender.join()


@pytest.mark.parametrize(
    "stream, error",
    [
        (b"!3\r\nabc\r\n", InvalidResponse),  # not a reply type the direct path takes
        (b"$3\r\nabcXY", InvalidResponse),  # a value not ended by CRLF
        (b"$x\r\n", InvalidResponse),  # not a number
        (b"$10\r\nabc", ConnectionResetError),  # cut: the server went away mid-value
        (b"+" + b"x" * (70 << 10), InvalidResponse),  # a header line with no end
    ],
)
@pytest.mark.asyncio
async def test_a_malformed_or_cut_reply_raises(wire: Any, stream: bytes, error: type) -> None:
    ours, theirs = wire
    theirs.sendall(stream) if len(stream) < 65536 else _send_later(theirs, stream).join()
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(error):
        await ReplyReader(ours).value_into([memoryview(bytearray(16))])


@pytest.mark.asyncio
async def test_a_long_answer_to_a_short_command_is_refused(wire: Any) -> None:
    ours, theirs = wire
    theirs.sendall(b"$999999999999\r\n")  # not allocated: the stream is not what was asked
    with pytest.raises(InvalidResponse):
        await ReplyReader(ours).reply()


# ----- against a server ------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_large_pages_move_without_staging(backend: RedisBackend) -> None:
    assert backend._client.direct is not None
    size = 1 << 20  # under the shared server's proto-max-bulk-len
    keys = [f"big-{i}" for i in range(6)]
    heads = [bytes([i]) * 64 for i in range(6)]
    payloads = [bytes([255 - i]) * (size - 64) for i in range(6)]
    before = (await backend.stats()).get("bytes_staged", 0)
    values = [[memoryview(h), memoryview(p)] for h, p in zip(heads, payloads, strict=True)]
    assert await backend.put(keys, values) == [True] * 6  # header and payload, not joined
    assert (await backend.stats()).get("bytes_staged", 0) == before
    buffers = [[memoryview(bytearray(64)), memoryview(bytearray(size))] for _ in keys]
    assert await backend.get_into(keys, buffers) == [size] * 6
    for segs, head, payload in zip(buffers, heads, payloads, strict=True):
        assert bytes(segs[0]) == head and bytes(segs[1][: size - 64]) == payload
    staged = (await backend.stats())["bytes_staged"] - before
    assert staged < 6 * size // 4, f"{staged} of {6 * size} bytes staged"


@pytest.mark.asyncio
async def test_reads_ask_for_a_window_of_values_at_a_time(backend: RedisBackend) -> None:
    """A large batch of GETs asks each connection for READ_WINDOW bytes of values at a time (the
    server then holds a window's replies, not the batch's), and every value still lands whole."""
    pool = backend._client.direct
    assert pool is not None
    size, count = 256 << 10, 24  # 6 MiB: two stripes, each in windows of 4 values
    keys = [f"win-{i}" for i in range(count)]
    assert await backend.put(keys, [bytes([i]) * size for i in range(count)]) == [True] * count
    asked: list[int] = []
    real_run = pool.run

    async def counted_run(address: Any, requests: Any, read: Any) -> Any:
        asked.append(sum(bytes(r[:4]) == b"*2\r\n" for r in requests))  # GET key: 2 parts
        return await real_run(address, requests, read)

    pool.run = counted_run  # type: ignore[method-assign]
    buffers = [[memoryview(bytearray(size))] for _ in keys]
    assert await backend.get_into(keys, buffers) == [size] * count
    assert all(bytes(b[0]) == bytes([i]) * size for i, b in enumerate(buffers))
    assert sum(asked) == count
    assert max(asked) == READ_WINDOW // size


@pytest.mark.asyncio
async def test_a_cancelled_read_stops_writing_into_the_buffers(backend: RedisBackend) -> None:
    size = 1 << 20
    keys = [f"cx-{i}" for i in range(32)]
    assert await backend.put(keys, [bytes([7]) * size] * 32) == [True] * 32
    buffers = [bytearray(size) for _ in keys]
    task = asyncio.ensure_future(backend.get_into(keys, buffers))
    await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen = [bytes(b) for b in buffers]
    await asyncio.sleep(0.2)  # the event loop runs on: no late reply may land
    assert [bytes(b) for b in buffers] == seen
    again = [bytearray(size) for _ in keys]
    assert await backend.get_into(keys, again) == [size] * 32  # the next batch is in step
    assert all(b == bytes([7]) * size for b in again)


@pytest.mark.asyncio
async def test_tls_pages_go_through_redis_py(tls_server: RedisServer) -> None:
    async with await open_redis(tls_server.url(key_prefix="d-tls:")) as backend:
        assert backend._client.direct is None
        assert await backend.put(["t"], [[memoryview(b"ab"), memoryview(b"cd")]]) == [True]
        assert await backend.get(["t"]) == [b"abcd"]


@pytest.mark.asyncio
async def test_keys_a_cluster_moved_are_followed(
    cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await open_redis(cluster.url(key_prefix="moved:")) as backend:
        keys = [f"m-{i}" for i in range(24)]
        values = [f"value {i}".encode() * 100 for i in range(24)]
        assert await backend.put(keys, values) == [True] * 24
        client = backend._client
        real = client.targets

        def one_node(rkeys: list[bytes]) -> Any:  # as if the slot map were stale
            (address, _), *_ = real(rkeys).values()
            return {"cluster node (stale map)": (address, list(range(len(rkeys))))}

        monkeypatch.setattr(client, "targets", one_node)
        followed: list[int] = []
        pipeline = client.client.pipeline
        monkeypatch.setattr(
            client.client, "pipeline", lambda **kw: followed.append(1) or pipeline(**kw)
        )
        assert await backend.get(keys) == values  # the others answered MOVED
        assert followed, "redis-py was sent the moved keys"
        assert await backend.put(keys, values[::-1]) == [True] * 24
        monkeypatch.undo()
        assert await backend.get(keys) == values[::-1]
        stats = await backend.stats()
        assert stats.get("errors", 0) == 0
        assert await backend.get_into(["absent"], [[memoryview(bytearray(8))]]) == [MISS]


@pytest.mark.asyncio
async def test_a_server_that_timed_out_is_skipped_for_a_while(own_server: RedisServer) -> None:
    pid = own_server.pid
    assert pid is not None
    async with await open_redis(own_server.url(timeout="0.3")) as backend:
        assert await backend.put(["bo"], [b"page"]) == [True]
        os.kill(pid, signal.SIGSTOP)  # connections open, nothing answers: a black hole
        try:
            started = time.monotonic()
            assert await backend.get(["bo"]) == [None]  # waits the timeout once
            waited = time.monotonic() - started
            assert waited >= 0.3
            started = time.monotonic()
            for _ in range(5):
                assert await backend.get(["bo"]) == [None]
                assert await backend.exists(["bo"]) == [False]
            assert time.monotonic() - started < 0.3, "skipped, not waited for again"
            assert (await backend.stats())["errors"] == 11
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(0.4)  # the wait is over: asked again, and it answers
        assert await backend.get(["bo"]) == [b"page"]
        assert await backend.exists(["bo"]) == [True]
