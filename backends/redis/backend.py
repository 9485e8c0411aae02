"""``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``: one page per key in Redis or Valkey.

URLs (every option in :class:`~hicache.backends.redis.config.RedisConfig`)::

    redis://127.0.0.1:6379/0?key_prefix=hicache:&ttl=3600
    rediss://user:PASSWORD@cache.example:6380?ca_file=/etc/ssl/ca.pem
    redis://10.0.0.5:7000?cluster=true
    redis:///0?sentinel=10.0.0.1:26379,10.0.0.2:26379&service=mymaster&password_file=/run/pw

The client is redis-py's asyncio API (``pip install 'hicache[redis]'``): it speaks RESP to Redis
and Valkey alike, and covers a server, Sentinel and Cluster in one library.

Keys: object ``k`` is the string value of ``key_prefix + k``; an empty object is an empty
string. A batch of ``exists``, ``get_into``, ``put``, ``put_missing`` or ``delete`` is one
pipeline (one per master in a cluster; see :mod:`.client` and :mod:`.pages`). ``ttl`` > 0
stores with ``EX`` and reads with ``GETEX ... EX``, so a page read within ``ttl`` seconds stays
(Redis 6.2+, Valkey).

Size: a value larger than the server's ``proto-max-bulk-len`` (read at open; 512 MiB unless
CONFIG cannot be read) is never sent: its put is False and counted (``put_too_large``), and
``capabilities.max_object_bytes`` says the limit. Pages are never split over several keys.

Copies: over plain TCP (a server, or a cluster's masters), page GETs and SETs run on hicache's
own connections (:mod:`.direct`, :mod:`.resp`): a value is received straight into the caller's
segments, and only the bytes that arrived with its reply's header line pass through a small
buffer (``bytes_staged``); a SET sends the page's segments as they are, never joined. Over TLS
and Sentinel, redis-py carries them: a value arrives as a new ``bytes`` and is copied once into
the caller's segments, and a value of several segments is joined before it is sent (both
counted in ``bytes_staged``). ``exists``, ``delete``, ``peek`` and listing always go through
redis-py.

Pages stay checked: this backend stores and returns bytes; the page codec above it decides
whether they are a page. A value another tool overwrote, one cut short, one evicted by
``maxmemory`` or expired by ``ttl`` is a miss there, never wrong KV.

Failures: a server that cannot be reached, restarts, answers ``LOADING``, ``OOM command not
allowed`` or times out makes that batch's keys misses (``get_into``, ``exists``, ``peek``) or
False (``put``, ``delete``), counted (``errors`` and one counter per operation); nothing is
raised but by ``scan``, whose caller must know a listing is incomplete. Connections are made
again on the next call. A server that timed out is not asked again for ``timeout`` seconds
(twice that after each later timeout, at most 30 s; any answer ends it): its batches fail at
once meanwhile, instead of each waiting ``timeout`` for a host that drops packets. The first
failure of an outage is logged as a warning, its end once; in a cluster, each master's outage on
its own (the others answering does not end it).

Listing: ``SCAN`` over ``key_prefix`` (every master in a cluster), a key reported once even
where SCAN repeats it. Redis keeps no write time: a listed ``mtime`` is the last access
(``OBJECT IDLETIME``), or the listing time under an LFU ``maxmemory-policy``; so ``hicache
compact --max-bytes`` removes the least recently used pages first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from redis.exceptions import ResponseError

from hicache.backends.base import (
    MISS,
    Capabilities,
    ObjectInfo,
    StorageBackend,
    segments_nbytes,
)
from hicache.backends.redis import pages
from hicache.backends.redis.client import FAILURES, RedisClient, close_quietly, connect
from hicache.backends.redis.config import (
    TLS_SCHEMES,
    RedisConfig,
    location_fields,
    password_from_env,
)
from hicache.errors import BackendUnavailableError, ConfigError
from hicache.keys import validate_key

__all__ = ["RedisBackend", "RedisConfig"]

logger = logging.getLogger(__name__)

_COUNTERS = (
    "errors",
    "exists_errors",
    "read_errors",
    "put_errors",
    "put_too_large",
    "delete_errors",
    "scan_errors",
)
_SCAN_COUNT = 1000  # keys a SCAN step asks for
_DESCRIBE_BATCH = 512  # listed keys sized per pipeline


class RedisBackend(StorageBackend):
    """Pages as string values in Redis or Valkey. See the module docstring."""

    name = "redis"
    url_schemes = ("redis", "rediss", "valkey", "valkeys")
    url_parts = frozenset({"host", "path"})  # [user:password@]host:port and /db
    capabilities = Capabilities(persistent=True, shared_across_processes=True, listable=True)
    config_type = RedisConfig

    def __init__(self, config: RedisConfig, client: RedisClient) -> None:
        super().__init__()
        self.config = config
        self._client = client
        self._prefix = config.key_prefix.encode()
        self.capabilities = replace(self.capabilities, max_object_bytes=client.max_bulk)
        # When each server (a cluster master, or the one server) started failing.
        self._down_since: dict[str, float] = {}
        for name in _COUNTERS:
            self._counters[name] = 0

    def __repr__(self) -> str:
        return f"RedisBackend({self._client.where}, key_prefix={self.config.key_prefix!r})"

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def config_from_url(cls, url: str, overrides: Mapping[str, Any]) -> Any:
        scheme, _, rest = url.partition("://")
        parts = urlsplit("x://" + rest)
        named = {name for name, _ in parse_qsl(parts.query, keep_blank_values=True)}
        if "tls" in named | set(overrides):
            raise ConfigError("redis URLs take no tls option: use rediss:// or valkeys://")
        if "@" in parts.netloc and named & {"username", "password"}:
            # Refused here: the base's "given twice" error would quote both values.
            raise ConfigError("a redis URL gives credentials in its user part or as options")
        config = super().config_from_url(url, {**overrides, "tls": scheme.lower() in TLS_SCHEMES})
        if config.password is None and config.password_file is None:
            secret = password_from_env()
            if secret is not None:
                config = replace(config, password=secret)
        return config

    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        return location_fields(netloc, path)

    @classmethod
    async def open(cls, config: RedisConfig) -> RedisBackend:
        """Connect and PING; raises ``BackendUnavailableError`` or, for credentials,
        ``ConfigError``."""
        return cls(config, await connect(config))

    # ----- backend operations -----------------------------------------------------------------
    def _rkeys(self, keys: list[str]) -> list[bytes]:
        prefix = self._prefix
        return [prefix + key.encode() for key in keys]

    async def _exists(self, keys: list[str]) -> list[bool]:
        replies, servers = await self._client.batch(self._rkeys(keys), lambda p, k: p.exists(k))
        return [
            self._ok(r, server, "exists_errors", "exists") and r == 1
            for r, server in zip(replies, servers, strict=True)
        ]

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        replies, servers, staged = await pages.read_into(
            self._client, self._rkeys(keys), buffers, self.config.ttl
        )
        self._count("bytes_staged", staged)
        out: list[int] = []
        for reply, server in zip(replies, servers, strict=True):
            good = reply is not None and self._ok(reply, server, "read_errors", "get")
            out.append(reply if good else MISS)
        return out

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        return await self._store(keys, values, only_new=False)

    async def _put_missing(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        # SET NX: one pipeline, no existence check first. Counted here: the base's put is
        # not on this path.
        return await self._store(keys, values, only_new=True)

    async def _store(
        self, keys: list[str], values: list[list[memoryview]], only_new: bool
    ) -> list[bool]:
        limit = self._client.max_bulk
        todo = [i for i, segs in enumerate(values) if segments_nbytes(segs) <= limit]
        self._count("put_too_large", len(keys) - len(todo))
        stored = [False] * len(keys)
        if todo:
            replies, servers = await self._send(
                [keys[i] for i in todo], [values[i] for i in todo], only_new
            )
            for i, reply, server in zip(todo, replies, servers, strict=True):
                # SET NX answers None where the key holds a value already: it is stored too.
                ok = self._ok(reply, server, "put_errors", "put")
                stored[i] = ok and bool(reply or only_new)
                if only_new and reply is True:
                    self._count("puts")
                    self._count("bytes_written", segments_nbytes(values[i]))
        if only_new:
            self._count("put_failures", stored.count(False))
        return stored

    async def _send(
        self, keys: list[str], values: list[list[memoryview]], only_new: bool
    ) -> tuple[list[Any], list[str]]:
        """``SET`` (``NX``) of each value, with ``EX`` when there is a ttl; the replies and
        each key's server."""
        replies, servers, staged = await pages.store(
            self._client, self._rkeys(keys), values, self.config.ttl, only_new
        )
        self._count("bytes_staged", staged)
        return replies, servers

    async def _delete(self, keys: list[str]) -> list[bool]:
        replies, servers = await self._client.batch(self._rkeys(keys), lambda p, k: p.delete(k))
        return [
            self._ok(r, server, "delete_errors", "delete") and r == 1
            for r, server in zip(replies, servers, strict=True)
        ]

    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        # EXISTS tells a missing key from an empty value, which GETRANGE both reads as b"".
        def queue(p: Any, k: bytes) -> None:
            p.exists(k)
            if nbytes:
                p.getrange(k, 0, nbytes - 1)

        per_key = 2 if nbytes else 1
        replies, servers = await self._client.batch(self._rkeys(keys), queue, per_key)
        out: list[bytes | None] = []
        for i, server in enumerate(servers):
            found, *head = replies[i * per_key : (i + 1) * per_key]
            good = all(self._ok(r, server, "read_errors", "peek") for r in (found, *head))
            out.append((head[0] if head else b"") if good and found == 1 else None)
        return out

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        # SCAN may return a key twice (while the server resizes its table): seen once here.
        seen: set[bytes] = set()
        pending: list[bytes] = []
        pattern = self._prefix + prefix.encode() + b"*"
        try:
            async for step in self._client.scan(pattern, _SCAN_COUNT):
                fresh = [rkey for rkey in step if rkey not in seen]
                seen.update(fresh)
                pending += fresh
                if len(pending) >= _DESCRIBE_BATCH:
                    for info in await self._describe(pending):
                        yield info
                    pending = []
            for info in await self._describe(pending):
                yield info
            self._answered(self._client.where)  # a listing that failed before has ended
        except FAILURES as exc:
            self._failed(self._client.where, "scan_errors", "scan", exc)
            raise BackendUnavailableError(
                f"listing redis {self._client.where} failed ({type(exc).__name__}: {exc})"
            ) from None

    async def _describe(self, rkeys: list[bytes]) -> list[ObjectInfo]:
        """Size and last access of listed keys; those gone since, or not strings, are left
        out (they are not pages of this store). Raises what a server that failed raised."""

        def queue(p: Any, k: bytes) -> None:
            p.strlen(k)
            p.object("idletime", k)

        replies, _ = await self._client.batch(rkeys, queue, per_key=2)
        now = time.time()
        cut = len(self._prefix)
        out = []
        for i, rkey in enumerate(rkeys):
            size, idle = replies[2 * i], replies[2 * i + 1]
            if isinstance(size, FAILURES) and not isinstance(size, ResponseError):
                raise size  # the server, not the key: the listing would be incomplete
            if not isinstance(size, int) or idle is None:
                continue  # gone, or not a string value
            key = rkey[cut:].decode("ascii", "replace")
            try:
                validate_key(key)
            except ValueError:
                continue  # another program's key under the prefix
            # Under an LFU policy Redis keeps no idle time: the listing time stands in.
            mtime = now - idle if isinstance(idle, int) else now
            out.append(ObjectInfo(key, size, mtime))
        return out

    async def _stats(self) -> dict[str, int | float]:
        return {"max_object_bytes": self._client.max_bulk}

    async def _close(self) -> None:
        await close_quietly(self._client)

    # ----- failures ----------------------------------------------------------------------------
    def _ok(self, reply: object, server: str, counter: str, what: str) -> bool:
        """Whether ``reply`` (from ``server``) is an answer, not a failure (counted)."""
        if isinstance(reply, Exception):
            self._failed(server, counter, what, reply)
            return False
        self._answered(server)
        return True

    def _answered(self, server: str) -> None:
        since = self._down_since.pop(server, None)
        if since is not None:
            logger.info("redis %s answers again after %.1f s", server, time.monotonic() - since)

    def _failed(self, server: str, counter: str, what: str, exc: BaseException) -> None:
        self._counters[counter] += 1
        self._counters["errors"] += 1
        # One warning per outage of each server (a cluster master down while the others
        # answer is one outage, not one per batch); the counters say how often.
        first = server not in self._down_since
        if first:
            self._down_since[server] = time.monotonic()
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "redis %s: %s failed (%s: %s); counted in %s",
            server,
            what,
            type(exc).__name__,
            exc,
            counter,
        )
