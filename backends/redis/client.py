"""The redis-py asyncio client a ``redis://`` backend talks through, and how a batch runs on it.

One client per backend: a single server behind a blocking connection pool (a call waits up to
``timeout`` for a free connection instead of failing), a :class:`RedisCluster`, or the master a
set of sentinels names. A batch is pipelined, never one round trip per key: one pipeline on a
server; in a cluster, one pipeline per master the keys' slots map to, sent concurrently, so a
master that is down fails only its own keys. redis-py follows MOVED and ASK itself. A batch of
large values is cut into a few pipelines per server, run at once on their own connections
(:data:`STRIPE_BYTES`).

Deadlines: ``timeout`` bounds connecting, and each batch, SCAN step or setup call as a whole
(one timer each). Not redis-py's ``socket_timeout`` (5 s by default in some versions), which
arms a timer per reply read: a pipeline of 32 ``EXISTS`` took a third longer with it here.

Each connection retries a failed exchange once, at once, on a new connection: a connection the
server closed (a restart, ``CLIENT KILL``, an idle timeout) costs no miss. Every command of a
batch may run twice that way; all of them are idempotent but ``DEL``'s count (a retried
delete may report a key it removed as absent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hicache.backends.redis.config import RedisConfig
from hicache.backends.redis.direct import Address, DirectPool, handshake
from hicache.errors import BackendUnavailableError, ConfigError

__all__ = [
    "CLIENT_NAME",
    "FAILURES",
    "MAX_BULK_DEFAULT",
    "MAX_STRIPES",
    "Queue",
    "RedisClient",
    "STRIPE_BYTES",
    "close_quietly",
    "connect",
    "stripe_runs",
]

logger = logging.getLogger(__name__)

# What a call to the server may fail with: the client's errors (connection, timeout, a reply
# such as LOADING or OOM) and the socket's own. Anything else is a bug and propagates.
FAILURES: tuple[type[Exception], ...] = (RedisError, OSError, asyncio.TimeoutError)
CLIENT_NAME = "hicache"
# proto-max-bulk-len's default: the server refuses a longer value.
MAX_BULK_DEFAULT = 512 << 20
# A batch of large values goes as several pipelines on their own connections, each of at least
# this many bytes, at most MAX_STRIPES per server: one connection moved 4 MiB values at 0.44-0.58
# GB/s here, eight at 1.9-2.6 GB/s (the server reads one while the client writes another;
# docs/BENCHMARKS.md, issue 47). Small batches stay one pipeline: one round trip.
STRIPE_BYTES = 4 << 20
MAX_STRIPES = 8
# A server that timed out (a host that drops packets, a frozen process) is not asked again for
# `timeout` seconds, twice that after each later try that times out too, at most this long:
# otherwise every batch would wait its whole `timeout` for it. A refused connection fails at
# once and costs no wait; any answer ends the wait.
BACKOFF_MAX_S = 30.0
#: Queues one key's commands on a pipeline: ``queue(pipeline, redis_key)``.
Queue = Callable[[Any, bytes], None]
T = TypeVar("T")
_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+; wait_for before


async def within(seconds: float, call: Awaitable[T]) -> T:
    """``call``, cancelled after ``seconds`` with ``TimeoutError`` (one of :data:`FAILURES`)."""
    if _timeout is None:
        return await asyncio.wait_for(call, seconds)
    async with _timeout(seconds):
        return await call


def _ssl_options(cfg: RedisConfig) -> dict[str, Any]:
    return {
        "ssl_ca_certs": cfg.ca_file,
        "ssl_certfile": cfg.cert_file,
        "ssl_keyfile": cfg.key_file,
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,  # not every redis-py version checks it by default
    }


def _connection_options(cfg: RedisConfig, password: str | None) -> dict[str, Any]:
    return {
        "username": cfg.username,
        "password": password,
        # No per-reply timer (some redis-py versions default to 5 s): see "Deadlines" above.
        "socket_timeout": None,
        "socket_connect_timeout": cfg.timeout,
        "retry": Retry(NoBackoff(), 1),
        # Named, for the redis-py versions (5.x) whose pipelines retry only what is listed.
        "retry_on_error": [RedisConnectionError],
        # Named, so that an operator's CLIENT LIST (and CLIENT KILL) can pick hicache out.
        "client_name": CLIENT_NAME,
    }


def _build(cfg: RedisConfig, password: str | None) -> Any:
    options = _connection_options(cfg, password)
    host, port = cfg.address
    if cfg.cluster:
        # Partial coverage is allowed: with a master down, the other masters' keys still work.
        extra = {"ssl": True, **_ssl_options(cfg)} if cfg.tls else {}
        return RedisCluster(
            host=host,
            port=port,
            max_connections=cfg.max_connections,
            require_full_coverage=False,
            **options,
            **extra,
        )
    if cfg.sentinel:
        tls = {"ssl": True, **_ssl_options(cfg)} if cfg.tls else {}
        # The sentinels are asked with the same timeout and TLS, with their own password.
        sentinel_options = {
            "socket_timeout": cfg.timeout,
            "socket_connect_timeout": cfg.timeout,
            "password": cfg.read_sentinel_password(),
        }
        sentinels = Sentinel(
            cfg.sentinels(), sentinel_kwargs={**sentinel_options, **tls}, **options, **tls
        )
        return sentinels.master_for(cfg.service, db=cfg.db, max_connections=cfg.max_connections)
    pool = BlockingConnectionPool(
        max_connections=cfg.max_connections,
        timeout=cfg.timeout,
        connection_class=SSLConnection if cfg.tls else Connection,
        host=host,
        port=port,
        db=cfg.db,
        **options,
        **(_ssl_options(cfg) if cfg.tls else {}),
    )
    return Redis.from_pool(pool)


def stripe_runs(
    group: list[int], sizes: list[int] | None, most: int = MAX_STRIPES
) -> list[list[int]]:
    """``group`` cut into runs of at least :data:`STRIPE_BYTES` (the last may be shorter), at
    most ``most`` of them; all of it when ``sizes`` is None or the group is small."""
    if sizes is None:
        return [group]
    total = sum(sizes[i] for i in group)
    share = max(STRIPE_BYTES, -(-total // most))
    parts: list[list[int]] = [[]]
    held = 0
    for i in group:
        if held >= share:
            parts.append([])
            held = 0
        parts[-1].append(i)
        held += sizes[i]
    return parts


def _where(cfg: RedisConfig) -> str:
    """The deployment in words, for messages; never with credentials."""
    host, port = cfg.address
    if cfg.sentinel:
        return f"service {cfg.service!r} at sentinels {cfg.sentinel}"
    # A cluster is named by its entry point, apart from its masters ("cluster node ...", as a
    # batch names them): an outage of one is not the other's.
    kind = "cluster at" if cfg.cluster else "server"
    return f"{kind} {host}:{port}" + (f" db {cfg.db}" if cfg.db else "")


class ServerSkipped(RedisConnectionError):
    """A batch not sent: its server timed out a moment ago (:data:`BACKOFF_MAX_S`)."""


class Backoff:
    """When each server that timed out may be asked again."""

    def __init__(self, first_s: float) -> None:
        self._first = first_s
        self._until: dict[str, tuple[float, float]] = {}  # server: (monotonic deadline, wait)

    def skipped(self, server: str) -> ServerSkipped | None:
        """The failure to give a batch for ``server`` now, or None to send it."""
        until, _ = self._until.get(server, (0.0, 0.0))
        left = until - time.monotonic()
        if left <= 0:
            return None
        return ServerSkipped(f"{server} timed out; not asked again for {left:.1f} s")

    def record(self, server: str, failure: BaseException | None) -> None:
        """After an exchange with ``server``: a timeout starts (or doubles) its wait; an answer
        ends it."""
        if failure is None:
            self._until.pop(server, None)
        elif isinstance(failure, TimeoutError | RedisTimeoutError):
            _, wait = self._until.get(server, (0.0, 0.0))
            wait = min(BACKOFF_MAX_S, 2 * wait if wait else self._first)
            self._until[server] = (time.monotonic() + wait, wait)


class RedisClient:
    """A connected client: batches as pipelines, the server's value limit, close."""

    def __init__(self, client: Any, cfg: RedisConfig, direct: DirectPool | None = None) -> None:
        self.client = client
        self.cluster = cfg.cluster
        self.where = _where(cfg)
        self.address = cfg.address
        self.max_bulk = MAX_BULK_DEFAULT
        self.timeout = cfg.timeout
        #: hicache's own connections for page GETs and SETs (:mod:`.direct`); None over TLS
        #: and Sentinel, where redis-py carries them too.
        self.direct = direct
        self.backoff = Backoff(cfg.timeout)

    async def batch(
        self, keys: list[bytes], queue: Queue, per_key: int = 1, sizes: list[int] | None = None
    ) -> tuple[list[Any], list[str]]:
        """Each key's ``per_key`` commands (queued by ``queue``) in one pipeline per server
        (several, on their own connections, when ``sizes``, each key's bytes, add up to more
        than :data:`STRIPE_BYTES`): the replies in key order, and the server each key went to,
        in words (:attr:`where`, or ``cluster node HOST:PORT``), so that the caller tells one
        server's outage from another's. A reply is an exception where the command failed, and
        every command of a pipeline that failed as a whole (the server could not be reached)
        gets that failure: the caller counts them, nothing is raised."""
        groups = self.targets(keys)
        stripes = [
            (server, part) for server, (_, g) in groups.items() for part in stripe_runs(g, sizes)
        ]
        out: list[Any] = [None] * (len(keys) * per_key)
        servers = [self.where] * len(keys)

        async def run(server: str, group: list[int]) -> None:
            pipe = self.client.pipeline(transaction=False)
            for i in group:
                queue(pipe, keys[i])
            try:
                if skipped := self.backoff.skipped(server):
                    raise skipped
                replies = await within(self.timeout, pipe.execute(raise_on_error=False))
                self.backoff.record(server, None)
            except FAILURES as exc:
                self.backoff.record(server, exc)
                replies = [exc] * (len(group) * per_key)
            for n, i in enumerate(group):
                out[i * per_key : (i + 1) * per_key] = replies[n * per_key : (n + 1) * per_key]
                servers[i] = server

        if len(stripes) == 1:
            await run(*stripes[0])
        else:
            await asyncio.gather(*(run(server, part) for server, part in stripes))
        return out, servers

    def targets(self, keys: list[bytes]) -> dict[str, tuple[Address | None, list[int]]]:
        """Key indexes per server (all of them, or per cluster master as last known), by the
        server's name in words, with its address (None: a slot no master serves)."""
        if not self.cluster:
            return {self.where: (self.address, list(range(len(keys))))}
        by_node: dict[str, tuple[Address | None, list[int]]] = {}
        manager = self.client.nodes_manager
        for i, key in enumerate(keys):
            try:
                node = manager.get_node_from_slot(self.client.keyslot(key))
                name, address = f"cluster node {node.name}", (node.host, node.port)
            except (RedisError, LookupError):  # a slot no node serves: its own pipeline fails
                name, address = "cluster (a slot no master serves)", None
            by_node.setdefault(name, (address, []))[1].append(i)
        return by_node

    async def scan(self, pattern: bytes, count: int) -> AsyncIterator[list[bytes]]:
        """The keys ``SCAN`` finds for ``pattern``, a step at a time, on every master of a
        cluster; raises what the client raises (a step past ``timeout`` too)."""
        client = self.client
        nodes = client.get_primaries() if self.cluster else [None]
        for node in nodes:
            cursor = 0
            while True:
                target = {} if node is None else {"target_nodes": node}
                step = client.scan(cursor, match=pattern, count=count, **target)
                cursor, keys = await within(self.timeout, step)
                if node is not None:  # a cluster answers per node
                    cursor = cursor[node.name]
                yield keys
                if cursor == 0:
                    break

    async def read_max_bulk(self) -> None:
        """The largest value the server takes (``proto-max-bulk-len``), where CONFIG may be
        read; the default otherwise (an ACL user without +config, a managed service)."""
        try:
            found = await within(self.timeout, self.client.config_get("proto-max-bulk-len"))
        except FAILURES as exc:
            logger.debug("CONFIG GET proto-max-bulk-len on %s: %s", self.where, exc)
            return
        value = found.get("proto-max-bulk-len") if isinstance(found, dict) else None
        if isinstance(value, bytes | str) and str(value).isdigit():
            self.max_bulk = int(value)

    async def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        await self.client.aclose()


async def connect(cfg: RedisConfig) -> RedisClient:
    """A client whose server answered PING (and AUTH); typed errors say what to fix."""
    password = cfg.read_password()
    direct = None
    if not (cfg.tls or cfg.sentinel):
        db = 0 if cfg.cluster else cfg.db
        setup = handshake(cfg.username, password, db, CLIENT_NAME)
        direct = DirectPool(setup, cfg.max_connections)
    client = RedisClient(_build(cfg, password), cfg, direct)
    try:
        if cfg.cluster:
            await within(cfg.timeout, client.client.initialize())
        await within(cfg.timeout, client.client.ping())
        await client.read_max_bulk()
    except AuthenticationError:
        await close_quietly(client)
        user = cfg.username or "default"
        raise ConfigError(
            f"redis {client.where}: authentication as user {user!r} failed; check the "
            "password (URL, password_file or HICACHE_REDIS_PASSWORD)"
        ) from None
    except ResponseError as exc:
        await close_quietly(client)
        raise BackendUnavailableError(f"redis {client.where} refused PING: {exc}") from None
    except FAILURES as exc:
        await close_quietly(client)
        hint = ""
        if cfg.sentinel and "AUTH" in str(exc):  # NOAUTH, WRONGPASS ... AUTH, ...
            hint = "; the sentinels ask for a password: sentinel_password or sentinel_password_file"
        raise BackendUnavailableError(
            f"cannot reach redis {client.where} ({type(exc).__name__}: {exc}){hint}"
        ) from None
    return client


async def close_quietly(client: RedisClient) -> None:
    """Close ``client``; a failure is logged at debug level (its connections go anyway)."""
    try:
        await client.close()
    except FAILURES as exc:  # the connections go with the client anyway
        logger.debug("closing %s: %s", client.where, exc)
