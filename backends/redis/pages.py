"""How a batch of page GETs or SETs runs: on hicache's own connections where there are any
(:mod:`.direct`), through redis-py otherwise, and for the keys a cluster moved.

Both paths give the same answers per key: a GET's value size (the value is in the caller's
buffer when it fits), ``None`` for no such key, or the exception that failed it; a SET's
``True`` (stored), ``None`` (``NX`` and the key holds a value already) or an exception. A
batch is one pipeline per server, cut into stripes on their own connections when its values are
large (:func:`.client.stripe_runs`). In a cluster a key whose slot moved since the client last
looked (``MOVED``, ``ASK``) is sent again through redis-py, which follows the redirection and
learns the new slot map.

Reads are paced (:data:`READS`): at most :data:`READ_STRIPES` stripes per server, each asking
for :data:`READ_WINDOW` bytes of values at a time, the next window once the last one's replies
are in. Redis builds each reply in a buffer of its own, and holds it until the client has
drained it; every buffer beyond what it reused is a page fault per 4 KiB. Timed around the
backend inside ``hicache bench lmcache --remote redis`` (a scratch timer, six rounds): 32 MiB of
512 KiB GETs in eight stripes asked at once took the server 6,800-8,000 page faults and 28-32 ms
of CPU, in windows of 1 MiB 120-360 faults and 8-10 ms; 64 MiB of 4 MiB GETs in eight windowed
stripes 10,000 faults and 48 ms of wall time, in four 1,400 faults and 31 ms.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hicache.backends._io_threads import outlive_cancel
from hicache.backends.base import copy_into_segments, segments_nbytes
from hicache.backends.redis.client import (
    FAILURES,
    MAX_STRIPES,
    RedisClient,
    stripe_runs,
    within,
)
from hicache.backends.redis.direct import Address
from hicache.backends.redis.resp import ReplyReader, command, store_frame
from hicache.backends.segments import byte_runs

__all__ = ["READS", "READ_STRIPES", "READ_WINDOW", "WRITES", "Pacing", "read_into", "store"]

#: Per key a reply, per key its server in words, and the bytes staged.
Outcome = tuple[list[Any], list[str], int]
Requests = Callable[[list[int]], list[bytes | memoryview]]
Replies = Callable[[list[int], ReplyReader], Awaitable[list[Any]]]


@dataclass(frozen=True, slots=True)
class Pacing:
    """How a batch's values go to one server: in at most ``stripes`` pipelines at once, each
    asking for at most ``window`` bytes of values at a time (one value at least; None: all)."""

    stripes: int
    window: int | None


#: The value bytes one connection asks a server for at once when reading (one value at least).
READ_WINDOW = 1 << 20
#: Stripes of GETs per server at once (writes use :data:`.client.MAX_STRIPES`).
READ_STRIPES = 4
READS = Pacing(READ_STRIPES, READ_WINDOW)
WRITES = Pacing(MAX_STRIPES, None)


async def read_into(
    client: RedisClient, keys: list[bytes], buffers: list[list[memoryview]], ttl: int
) -> Outcome:
    """``GET`` (``GETEX ... EX ttl`` with a ttl, so that a read page stays) of each key into
    its buffers: the replies (see the module docstring), each key's server in words, and the
    bytes staged on the way."""
    sizes = [segments_nbytes(segs) for segs in buffers]
    if client.direct is None:
        return await _read_by_client(client, keys, buffers, ttl, sizes)

    def requests(group: list[int]) -> list[bytes | memoryview]:
        if ttl:
            return [command(b"GETEX", keys[i], b"EX", b"%d" % ttl) for i in group]
        return [command(b"GET", keys[i]) for i in group]

    async def replies(group: list[int], reader: ReplyReader) -> list[Any]:
        return [await reader.value_into(buffers[i]) for i in group]

    def again(moved: list[int]) -> Awaitable[Outcome]:
        return _read_by_client(
            client, [keys[i] for i in moved], [buffers[i] for i in moved], ttl, None
        )

    return await _direct(client, keys, sizes, (requests, replies), again, READS)


async def store(
    client: RedisClient, keys: list[bytes], values: list[list[memoryview]], ttl: int, nx: bool
) -> Outcome:
    """``SET`` (``NX`` when ``nx``; ``EX ttl`` with a ttl) of each value: the replies, each
    key's server, and the bytes staged (values of several segments joined on redis-py's
    path; none on the direct one, which sends the segments as they are)."""
    sizes = [segments_nbytes(segs) for segs in values]
    if client.direct is None:
        return await _store_by_client(client, keys, values, ttl, nx)

    def requests(group: list[int]) -> list[bytes | memoryview]:
        pieces: list[bytes | memoryview] = []
        for i in group:
            head, tail = store_frame(keys[i], sizes[i], ttl, nx)
            pieces += [head, *values[i], tail]
        return pieces

    async def replies(group: list[int], reader: ReplyReader) -> list[Any]:
        return [_stored(await reader.reply()) for _ in group]

    def again(moved: list[int]) -> Awaitable[Outcome]:
        return _store_by_client(
            client, [keys[i] for i in moved], [values[i] for i in moved], ttl, nx
        )

    return await _direct(client, keys, sizes, (requests, replies), again, WRITES)


async def _direct(
    client: RedisClient,
    keys: list[bytes],
    sizes: list[int],
    exchange: tuple[Requests, Replies],
    again: Callable[[list[int]], Awaitable[Outcome]],
    pacing: Pacing,
) -> Outcome:
    """Each server's keys as stripes on the direct connections, at once, each stripe in
    exchanges of at most ``pacing.window`` value bytes; an exchange that fails gives each of
    its keys and the stripe's later ones that failure. The keys a cluster redirected are sent
    ``again`` (through redis-py)."""
    requests, replies = exchange
    assert client.direct is not None
    pool = client.direct
    out: list[Any] = [None] * len(keys)
    servers = [client.where] * len(keys)
    staged = 0

    def settle(server: str, part: list[int], found: list[Any]) -> None:
        for i, reply in zip(part, found, strict=True):
            out[i] = reply
            servers[i] = server

    async def run(server: str, address: Address | None, group: list[int]) -> None:
        nonlocal staged
        done = 0
        try:
            if address is None:
                raise ConnectionError(f"{server}: no master serves these keys' slots")
            if skipped := client.backoff.skipped(server):
                raise skipped
            for part in _windows(group, sizes, pacing.window):
                sent = pool.run(address, requests(part), functools.partial(replies, part))
                found, spilled = await within(client.timeout, sent)
                staged += spilled
                settle(server, part, found)
                done += len(part)
            client.backoff.record(server, None)
        except FAILURES as exc:
            client.backoff.record(server, exc)
            settle(server, group[done:], [exc] * (len(group) - done))

    stripes = [
        (server, address, part)
        for server, (address, group) in client.targets(keys).items()
        for part in stripe_runs(group, sizes, pacing.stripes)
    ]
    await asyncio.gather(*(run(*stripe) for stripe in stripes))
    moved = _redirected(out)
    if moved:
        redone, _, more = await again(moved)
        for i, reply in zip(moved, redone, strict=True):
            out[i] = reply
        staged += more
    return out, servers, staged


def _windows(group: list[int], sizes: list[int], window: int | None) -> list[list[int]]:
    """``group`` in runs of at most ``window`` bytes (a larger value alone); whole without."""
    if window is None:
        return [group]
    return [[group[j] for j in run] for run in byte_runs([sizes[i] for i in group], window)]


def _redirected(replies: list[Any]) -> list[int]:
    """The keys a cluster answered with ``MOVED`` or ``ASK``."""
    return [
        i
        for i, reply in enumerate(replies)
        if isinstance(reply, Exception) and str(reply).startswith(("MOVED ", "ASK "))
    ]


def _stored(reply: object) -> object:
    return True if reply == b"OK" else reply


async def _read_by_client(
    client: RedisClient,
    keys: list[bytes],
    buffers: list[list[memoryview]],
    ttl: int,
    sizes: list[int] | None,
) -> Outcome:
    """The same GETs through redis-py; each value copied into its buffers after the batch
    returned (a cancelled read copies nothing)."""
    read = (lambda p, k: p.getex(k, ex=ttl)) if ttl else (lambda p, k: p.get(k))
    out, servers = await client.batch(keys, read, sizes=sizes)
    staged = 0
    for n, (reply, segs) in enumerate(zip(out, buffers, strict=True)):
        if isinstance(reply, bytes | bytearray):
            size = len(reply)
            if size <= segments_nbytes(segs):
                copy_into_segments(memoryview(reply), segs)
                staged += size
            out[n] = size
    return out, servers, staged


async def _store_by_client(
    client: RedisClient, keys: list[bytes], values: list[list[memoryview]], ttl: int, nx: bool
) -> Outcome:
    """The same SETs through redis-py, a value of several segments joined into one first."""
    bodies = dict(zip(keys, map(_body, values), strict=True))
    staged = sum(segments_nbytes(v) for v in values if len(v) > 1)

    def queue(p: Any, k: bytes) -> None:
        p.set(k, bodies[k], ex=ttl or None, nx=nx)

    # Shielded: a one-segment body is the caller's memory, which redis-py holds until its
    # pipeline ends (a retry sends it again); a cancelled put returns once nothing does.
    sizes = [memoryview(body).nbytes for body in bodies.values()]
    sent = client.batch(list(bodies), queue, sizes=sizes)
    out, servers = await outlive_cancel(asyncio.ensure_future(sent))
    return out, servers, staged


def _body(segments: list[memoryview]) -> memoryview | bytes:
    """What redis-py's SET sends: the one segment itself, or the segments joined."""
    return segments[0] if len(segments) == 1 else b"".join(segments)
