"""``s3://``, ``gs://``, ``az://`` and any fsspec URL: one object per key under a prefix.

``s3://bucket/prefix?endpoint_url=http://host:9000&key=...&secret=...`` stores key ``k`` as the
object ``bucket/prefix/k``. Other fsspec filesystems are named explicitly, since ``memory://``
and ``file://`` belong to hicache's own backends: ``fsspec+memory://name`` (fsspec's in-process
store) or ``fsspec+file:///path``.

Batches run concurrently (at most ``max_concurrency`` requests in flight per backend) on
fsspec's IO loop, whatever loop the caller runs: the backend can be opened in one event loop
and used from another, and the caller's loop never blocks on the network. A sync-only
filesystem is wrapped so that each call runs in a worker thread.

Atomicity: an S3 object is written by one PUT (or one multipart upload, published whole at its
completion); file-like targets get a temporary ``.<key>....tmp`` beside the object, then a move.
A put that fails (permission, bucket gone, endpoint down) is False and counted; a read that
fails is a miss and counted (``errors`` and one counter per operation), never an exception.
Credentials are never logged and never appear in the config's repr or in error messages.

Copies: a put joins the value's segments into one ``bytes`` body, and a read gets the object as
``bytes`` and copies it into the caller's segments; both count as ``bytes_staged``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote

import fsspec
import fsspec.asyn

from hicache.backends.base import (
    MISS,
    Capabilities,
    ObjectInfo,
    StorageBackend,
    copy_into_segments,
    segments_nbytes,
)
from hicache.backends.fsspec.config import OBJECT_STORES, S3_PROTOCOLS, FsspecConfig
from hicache.backends.fsspec.ops import (
    FsOps,
    ObjectStoreOps,
    S3Ops,
    filesystem,
    open_error,
)
from hicache.errors import BackendUnavailableError, ConfigError

__all__ = ["FsspecBackend", "FsspecConfig"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound="FsspecBackend")

_COUNTERS = (
    "errors",
    "put_errors",
    "read_errors",
    "exists_errors",
    "delete_errors",
    "scan_errors",
)


def _as_bytes(segments: list[memoryview]) -> bytes:
    # bytes, not bytearray: botocore wraps the body in BytesIO, which shares bytes but copies
    # a bytearray.
    return bytes(segments[0]) if len(segments) == 1 else b"".join(segments)


class _Failed:
    """A per-key failure carried back from the IO loop, to be counted by the caller."""

    __slots__ = ("exc",)

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class FsspecBackend(StorageBackend):
    """Objects in any fsspec filesystem, S3 first. See the module docstring."""

    name = "fsspec"
    url_schemes = ("s3", "s3a", "gs", "gcs", "az", "abfs")
    url_parts = frozenset({"host", "path"})  # bucket/prefix (or a memory store's path)
    capabilities = Capabilities(persistent=True, shared_across_processes=True, listable=True)
    config_type = FsspecConfig

    def __init__(self, config: FsspecConfig, ops: FsOps) -> None:
        super().__init__()
        self.config = config
        self._ops = ops
        self._where = f"{config.protocol}://{config.root}"
        self._loop = fsspec.asyn.get_loop()
        # Used only on the IO loop, so it binds to that loop whichever loop the caller runs.
        self._limit = asyncio.Semaphore(config.max_concurrency)
        self._n = dict.fromkeys(_COUNTERS, 0)
        self._warned: set[str] = set()
        if config.protocol == "memory":  # fsspec's memory store lives in this process only
            self.capabilities = Capabilities(persistent=False, shared_across_processes=False)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def config_from_url(cls, url: str, overrides: Mapping[str, Any]) -> Any:
        options = dict(overrides)
        if isinstance(options.get("storage_options"), Mapping):
            options["storage_options"] = json.dumps(options["storage_options"])
        scheme = url.partition("://")[0].lower()
        return super().config_from_url(url, {"protocol": scheme, **options})

    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        if "@" in netloc:  # the user part is not shown: it holds credentials
            raise ConfigError(
                "credentials in the URL's user part are refused: pass the key= and secret= "
                "options (or storage_options) instead"
            )
        return {"root": unquote(netloc + path)}

    @classmethod
    async def open(cls: type[F], config: Any) -> F:
        """Create the filesystem client and probe the store; typed errors say what to fix."""
        fs = filesystem(config)
        backend = cls(config, _ops_for(config, fs))
        try:
            await backend._on_loop(backend._ops.probe(config.create_bucket))
        except Exception as exc:
            await backend._close()
            raise open_error(exc, config) from None
        return backend

    # ----- backend operations -----------------------------------------------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        sizes = await self._batch(self._ops.size, [(k,) for k in keys])
        return [self._ok(s, "exists_errors", "exists") and s is not None for s in sizes]

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        limits = [segments_nbytes(segs) for segs in buffers]
        results = await self._batch(self._ops.read, list(zip(keys, limits)))
        out: list[int] = []
        for result, segs in zip(results, buffers):
            if isinstance(result, _Failed):
                self._failed("read_errors", "read", result.exc)
                out.append(MISS)
                continue
            size, data = result
            if data is not None:  # copied here, not on the IO loop: a cancelled get never
                copy_into_segments(memoryview(data), segs)  # writes the caller's buffers late
                self._count("bytes_staged", len(data))
            out.append(size)
        return out

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        # One copy per value, made here in the caller's thread, so nothing reads the caller's
        # buffers once we return or are cancelled; the request bodies need bytes anyway.
        items = [(key, _as_bytes(segs)) for key, segs in zip(keys, values)]
        results = await self._batch(self._ops.write, items)
        stored = [self._ok(r, "put_errors", "put") for r in results]
        staged = sum(len(body) for (_, body), ok in zip(items, stored, strict=True) if ok)
        self._count("bytes_staged", staged)
        return stored

    async def _delete(self, keys: list[str]) -> list[bool]:
        sizes = await self._batch(self._ops.size, [(k,) for k in keys])
        present = [self._ok(s, "delete_errors", "delete") and s is not None for s in sizes]
        doomed = sorted({k for k, p in zip(keys, present) if p})
        if doomed:
            try:
                await self._on_loop(self._ops.remove(doomed))
            except Exception as exc:
                self._failed("delete_errors", "delete", exc)
                return [False] * len(keys)
        # A key named twice was there once: the first mention reports it.
        seen: set[str] = set()
        out = []
        for key, p in zip(keys, present):
            out.append(p and key not in seen)
            seen.add(key)
        return out

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        token: Any = None
        while True:
            try:
                infos, token = await self._on_loop(self._ops.list_page(prefix, token))
            except Exception as exc:
                self._failed("scan_errors", "scan", exc)
                raise BackendUnavailableError(
                    f"listing {self._where} failed ({type(exc).__name__}: {exc}); check the "
                    "endpoint, the credentials and that the bucket still exists"
                ) from None
            for info in infos:
                yield info
            if token is None:
                return

    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        results = await self._batch(self._ops.head, [(k, nbytes) for k in keys])
        out: list[bytes | None] = []
        for result in results:
            if isinstance(result, _Failed):
                self._failed("read_errors", "peek", result.exc)
                result = None
            out.append(result)
        return out

    async def _stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self._n)
        out["max_concurrency"] = self.config.max_concurrency
        return out

    async def _close(self) -> None:
        try:
            await self._on_loop(self._ops.close())
        except Exception as exc:  # the client's sockets go with it: nothing left to do
            logger.debug("closing %s: %s", self._where, type(exc).__name__)

    # ----- running on the IO loop -------------------------------------------------------------
    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on fsspec's IO loop; cancelling the caller cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _batch(
        self, fn: Callable[..., Coroutine[Any, Any, T]], items: Sequence[tuple[Any, ...]]
    ) -> list[T | _Failed]:
        """``fn(*item)`` for every item on the IO loop, concurrently within the limit.

        A failure comes back as a value, for the caller to count; the order is the items'.
        """

        async def one(item: tuple[Any, ...]) -> T | _Failed:
            async with self._limit:
                try:
                    return await fn(*item)
                except Exception as exc:  # counted and logged by the caller, per key
                    return _Failed(exc)

        async def run() -> list[T | _Failed]:
            return list(await asyncio.gather(*(one(item) for item in items)))

        return await self._on_loop(run())

    def _ok(self, result: object, counter: str, what: str) -> bool:
        if isinstance(result, _Failed):
            self._failed(counter, what, result.exc)
            return False
        return True

    def _failed(self, counter: str, what: str, exc: BaseException) -> None:
        self._n[counter] += 1
        self._n["errors"] += 1
        # An endpoint that went away fails every call: one warning per kind says it, the
        # counters say how often.
        first = counter not in self._warned
        self._warned.add(counter)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s on %s failed (%s: %s); counted in %s",
            what,
            self._where,
            type(exc).__name__,
            exc,
            counter,
        )


def _ops_for(config: FsspecConfig, fs: Any) -> FsOps:
    where = f"{config.protocol}://{config.root}"
    root = fs._strip_protocol(config.root)
    if config.protocol in S3_PROTOCOLS:
        return S3Ops(fs, root, where, config.region)
    if config.protocol in OBJECT_STORES:
        return ObjectStoreOps(fs, root, where)
    return FsOps(fs, root, atomic_writes=config.protocol == "memory", where=where)
