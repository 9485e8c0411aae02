"""The raw redis-py baseline of ``hicache bench backends --backend redis``, and its server.

The baseline is a bare ``redis.asyncio`` client of its own (a plain connection pool, no retry
settings, no name) on the server the backend was opened on, moving the same bytes the plainest
way the library offers, on the bench's own event loop as the backend does: per batch of the
bench's 32 keys, one pipeline of ``SET``, of ``GET`` (each value then copied into its
destination row, as any caller that wants the bytes in its own buffer must), or of ``EXISTS``.
Its keys carry a ``raw-<id>:`` prefix, apart from the backend's, and are deleted after the run
(the backend's stay, under its ``key_prefix``: with ``--url``, remove them after).

Without ``--url``, ``provision`` starts a ``redis-server`` for the run (nothing saved, no memory
limit) in the scratch directory and stops it after. A cluster URL (``cluster=true``) gets the
same baseline through ``RedisCluster``'s pipeline, which splits each batch per node itself.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.backends.redis import RedisBackend
from hicache.backends.redis.config import RedisConfig
from hicache.tools.services.redis import RedisServer

__all__ = ["AsyncBaseline", "async_baseline", "provision"]

#: Moves the objects ``lo`` to ``hi - 1`` of the bench's work: ``move(work, lo, hi)``.
AsyncMove = Callable[[Any, int, int], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class AsyncBaseline:
    """One batch each way, on the caller's event loop."""

    put: AsyncMove
    get: AsyncMove
    exists: AsyncMove


def _raw_client(config: RedisConfig) -> Any:
    """A redis-py client with the library's defaults, at the backend's server."""
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    host, port = config.address
    options: dict[str, Any] = {"username": config.username, "password": config.read_password()}
    if config.tls:
        options |= {"ssl": True, "ssl_ca_certs": config.ca_file}
        options |= {"ssl_certfile": config.cert_file, "ssl_keyfile": config.key_file}
    if config.sentinel:
        raise ValueError("the raw redis baseline takes a server or cluster URL, not sentinel=")
    if config.cluster:
        return RedisCluster(host=host, port=port, **options)
    return Redis(host=host, port=port, db=config.db, **options)


@contextlib.asynccontextmanager
async def async_baseline(backend: Any, work: Any) -> AsyncIterator[AsyncBaseline]:
    """(put, get, exists) of one batch through a bare redis-py pipeline; closed after."""
    if not isinstance(backend, RedisBackend):
        raise TypeError(f"the redis baseline needs a RedisBackend, not {type(backend)}")
    client = _raw_client(backend.config)
    tag = uuid.uuid4().hex[:8]
    keys = [f"raw-{tag}:{k}".encode() for k in work.keys]
    size = int(work.source.shape[1])

    async def put(w: Any, lo: int, hi: int) -> None:
        pipe = client.pipeline(transaction=False)
        for j in range(lo, hi):
            pipe.set(keys[j], memoryview(w.source[j]))
        await pipe.execute()

    async def get(w: Any, lo: int, hi: int) -> None:
        pipe = client.pipeline(transaction=False)
        for j in range(lo, hi):
            pipe.get(keys[j])
        for j, value in zip(range(lo, hi), await pipe.execute(), strict=True):
            if value is None or len(value) != size:
                raise RuntimeError(f"the raw redis baseline missed {keys[j]!r}")
            np.copyto(w.dest[j], np.frombuffer(value, dtype=np.uint8))

    async def exists(w: Any, lo: int, hi: int) -> None:
        pipe = client.pipeline(transaction=False)
        for j in range(lo, hi):
            pipe.exists(keys[j])
        if sum(await pipe.execute()) != hi - lo:
            raise RuntimeError("the raw redis baseline lost a key")

    try:
        yield AsyncBaseline(put, get, exists)
        pipe = client.pipeline(transaction=False)
        for key in keys:  # one DEL each: a cluster's keys lie in many slots
            pipe.delete(key)
        await pipe.execute()
    finally:
        await client.aclose()


@contextlib.contextmanager
def provision(scratch: str, total_bytes: int) -> Iterator[str]:
    """A ``redis-server`` for the run, with room for both sides' objects; yields its URL."""
    with RedisServer(scratch) as server:
        yield server.url()
