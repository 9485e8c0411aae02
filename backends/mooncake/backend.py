"""``mooncake://``: objects in a Mooncake Store cluster (distributed DRAM, TCP or RDMA).

URL::

    mooncake://127.0.0.1:50051?metadata_server=http://127.0.0.1:8080/metadata
        &admin_url=http://127.0.0.1:9003&global_segment_bytes=4G&protocol=tcp

The location is the master's RPC address. This process's client contributes
``global_segment_bytes`` of its memory to the cluster; its puts go to that segment while it has
room (``prefer_local_segment``: a memcpy instead of a transfer), else to any client's segment,
and live while that client and the master live. Nothing survives a master
restart, and the objects in this client's segment go when it closes (``persistent`` is False).

Memory: a host pool calls :meth:`MooncakeBackend.register_memory` once for its whole buffer
(the tiered cache also registers the arena of its page headers); objects whose segments all lie
inside registered memory move straight between them and the store (``zero_copy_bytes``), a
header slot and its page in one object. Other buffers are copied through one staging buffer
registered at open (``bytes_staged``); so are registered multi-segment values whose key already
exists, since only the staged path replaces an object (see ``client``).

Keys: object ``k`` is Mooncake key ``key_prefix + k``. Mooncake refuses empty values, so an
empty object is a one-byte marker under ``key_prefix + k + "#empty"`` (``#`` is outside the key
alphabet, so no key collides with a marker); a stored ``k`` wins over a stale marker.

Listing: Mooncake's client has none; the master's HTTP admin server (``--metrics_port``) does
(``/get_all_keys``). With ``admin_url`` set, ``scan`` works (``listable``); it reports the
listing time as ``mtime``, since Mooncake keeps no write times. Without it, scan raises.

Clients: backends in one process opened with the same settings share one Mooncake client
(see ``connection``); it closes, and its segment leaves the cluster, with the last of them.

Failures: a full store is a False put (``put_full``); a master that cannot be reached makes
calls fail fast as misses and False (``unavailable``) while the backend retries with backoff,
and rebuilds its client if the master is back but calls keep failing (``rebuilds``). Closing
never stops the event loop for a dead master: a client whose master does not answer within
``close_timeout_s`` is left open instead (``close_abandoned``; see ``connection``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from hicache.backends._buffers import address_of, flat_view
from hicache.backends._io_threads import outlive_cancel
from hicache.backends.base import MISS, Capabilities, ObjectInfo, StorageBackend, segments_nbytes
from hicache.backends.mooncake.admin import MARKER, list_objects
from hicache.backends.mooncake.client import (
    CONNECTION_CODES,
    NO_SPACE,
    NOT_FOUND,
    OK,
    RPC_FAIL,
    MooncakeClient,
    SetupParams,
    load_store_class,
    lost_master,
    master_address,
)
from hicache.backends.mooncake.connection import Connection, Unavailable
from hicache.backends.mooncake.gate import local_address, reachable
from hicache.errors import (
    BackendClosedError,
    BackendUnavailableError,
    ConfigError,
    InvalidArgumentError,
)

# What ``_call`` gives back while the master cannot be reached, told apart from None.
_UNREACHED: Any = object()

__all__ = ["MooncakeBackend", "MooncakeConfig", "setup_params"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_PREFIX_RE = re.compile(r"[A-Za-z0-9._/:-]*\Z")
_MIN_SEGMENT_BYTES = 16 << 20  # setup answers -600 (INVALID_PARAMS) below this (measured)
_COUNTERS = (
    "put_full",
    "put_errors",
    "read_errors",
    "rpc_errors",
    "unavailable",
    "close_abandoned",
)


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """Options of a ``mooncake://host:port`` URL (the master's RPC address)."""

    master: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"  # or the master's http://host:port/metadata
    admin_url: str | None = None  # the master's http://host:metrics_port, for scan
    global_segment_bytes: int = 1 << 30  # memory this client gives the cluster
    local_buffer_bytes: int = 64 << 20  # the client's own transfer buffer
    staging_bytes: int = 64 << 20  # registered bounce buffer for unregistered memory
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = ""  # the address peers reach this client at; "" = toward the master
    key_prefix: str = ""  # namespace inside the cluster
    prefer_local_segment: bool = True  # place puts in this client's segment while it has room
    retry_backoff_s: float = 0.5  # first wait after a failed call; doubles up to 16x
    rebuild_after_s: float = 5.0  # failing this long with the master reachable: new client
    close_timeout_s: float = 2.0  # the master must answer within this at close, or the client
    # is left open (a close against a dead master stops the whole process for 14-19 s)

    def __post_init__(self) -> None:
        host, sep, port = self.master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"mooncake master must be host:port, got {self.master!r}")
        if self.global_segment_bytes < _MIN_SEGMENT_BYTES:
            raise ConfigError(
                f"MooncakeConfig.global_segment_bytes must be at least 16M (Mooncake refuses "
                f"smaller segments), got {self.global_segment_bytes}"
            )
        sizes = (self.local_buffer_bytes, self.staging_bytes)
        if min(sizes) <= 0:
            raise ConfigError(
                "MooncakeConfig.local_buffer_bytes and staging_bytes must be positive"
            )
        if not _PREFIX_RE.match(self.key_prefix):
            raise ConfigError(
                f"key_prefix {self.key_prefix!r} may hold only letters, digits and . _ / : -"
            )
        if self.retry_backoff_s <= 0 or self.rebuild_after_s < 0 or self.close_timeout_s <= 0:
            raise ConfigError(
                "retry_backoff_s and close_timeout_s must be positive, rebuild_after_s not negative"
            )
        if self.admin_url is not None and not self.admin_url.startswith(("http://", "https://")):
            raise ConfigError(f"admin_url must be http(s)://host:port, got {self.admin_url!r}")

    @property
    def master_host(self) -> str:
        return master_address(self.master)[0]

    @property
    def master_port(self) -> int:
        return master_address(self.master)[1]


class MooncakeBackend(StorageBackend):
    """A Mooncake Store client: shared, non-persistent DRAM objects, zero-copy when registered."""

    name = "mooncake"
    url_schemes = ("mooncake",)
    url_parts = frozenset({"host"})  # the master, host:port; a path is refused by the base
    capabilities = Capabilities(
        persistent=False, shared_across_processes=True, zero_copy=True, listable=False
    )
    config_type = MooncakeConfig

    def __init__(self, config: MooncakeConfig) -> None:
        super().__init__()
        self.config = config
        if config.admin_url is not None:
            self.capabilities = replace(self.capabilities, listable=True)
        self._conn: Connection | None = None
        for name in _COUNTERS:
            self._counters[name] = 0

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        if not netloc:
            return {}
        return {"master": netloc if ":" in netloc.lstrip("[") else f"{netloc}:50051"}

    @classmethod
    async def open(cls, config: MooncakeConfig) -> MooncakeBackend:
        backend = cls(config)
        backend._conn = await asyncio.to_thread(_connect, config)
        return backend

    # ----- registered memory ----------------------------------------------------------------
    def register_memory(self, buffer: Any) -> bool:
        """Register a host buffer once; moves from or to it then skip the staging copy.

        Call it at setup (a host pool's whole buffer); the buffer must stay alive and unchanged
        in size until :meth:`unregister_memory` or close. False when it already lies inside
        registered memory. It waits for a call in flight on the client, so not per request.
        Registered memory belongs to the client, which backends with the same settings share.
        """
        conn = self._live()
        view = flat_view(buffer)
        if view.nbytes == 0:
            return False
        start = address_of(view)
        with conn.lock:
            client = _require(conn.client)
            if client.regions.contains(start, view.nbytes):
                return False
            if client.regions.overlaps(start, view.nbytes):
                raise InvalidArgumentError("register_memory: the buffer overlaps registered memory")
            client.register(start, view.nbytes)
        return True

    def unregister_memory(self, buffer: Any) -> bool:
        """Undo :meth:`register_memory` for the same buffer; False if it was not registered."""
        conn = self._live()
        with conn.lock:
            return _require(conn.client).unregister(address_of(flat_view(buffer)))

    # ----- operations -----------------------------------------------------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self._object_or_marker(keys, lambda s, m: s.batch_is_exist(m), 1, "exists")

    async def _object_or_marker(
        self, keys: list[str], call: Callable[[Any, list[str]], list[int]], hit: int, what: str
    ) -> list[bool]:
        """``call(store, mkeys)`` over each key's object and its empty-object marker; per key,
        whether either answered ``hit``. All False while the master cannot be reached."""
        mkeys = self._mkeys(keys) + self._markers(keys)
        out = await self._call(lambda c: self._checked(call(c.store, mkeys), what), None)
        if out is None:
            return [False] * len(keys)
        n = len(keys)
        return [out[i] == hit or out[n + i] == hit for i in range(n)]

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        return await self._call(lambda c: self._read(c, keys, buffers), [MISS] * len(keys))

    def _read(
        self, client: MooncakeClient, keys: list[str], buffers: list[list[memoryview]]
    ) -> list[int]:
        codes = client.get_into(self._mkeys(keys), buffers)
        lost = self._failed(codes, "get")
        missing = [i for i, rc in enumerate(codes) if rc == NOT_FOUND]
        if missing and not lost:  # an empty object is a marker, not a Mooncake object
            marks = client.store.batch_is_exist(self._markers([keys[i] for i in missing]))
            for i, mark in zip(missing, marks, strict=True):
                codes[i] = 0 if mark == 1 else MISS
        errors = [rc for rc in codes if rc < MISS]
        if errors:
            self._count("read_errors", len(errors))
        return [rc if rc >= 0 else MISS for rc in codes]

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        return await self._call(lambda c: self._write(c, keys, values), [False] * len(keys))

    def _write(
        self, client: MooncakeClient, keys: list[str], values: list[list[memoryview]]
    ) -> list[bool]:
        full = [i for i, segs in enumerate(values) if segments_nbytes(segs) > 0]
        empty = [i for i, segs in enumerate(values) if segments_nbytes(segs) == 0]
        codes = [RPC_FAIL] * len(keys)  # what a key not reached keeps
        if full:
            out = client.put(self._mkeys([keys[i] for i in full]), [values[i] for i in full])
            for i, rc in zip(full, out, strict=True):
                codes[i] = rc
            stored = [keys[i] for i, rc in zip(full, out, strict=True) if rc == OK]
            if lost_master(out):
                empty = []  # no more calls that would each wait out the master's timeout
            elif stored:  # a stale empty-marker must not outlive the object that replaced it
                client.store.batch_remove(self._markers(stored), True)
        if empty:
            names = [keys[i] for i in empty]
            if not lost_master(client.store.batch_remove(self._mkeys(names), True)):
                for i, rc in zip(empty, client.put_marker(self._markers(names)), strict=True):
                    codes[i] = rc
        self._failed(codes, "put")
        return [rc == OK for rc in codes]

    async def _put_missing(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        # Native where every value lies in registered memory (a host pool and its header
        # arena): one multi-buffer put, no existence check, no marker to clear (a value that
        # is stored is never empty). Anything else: the base's check and put.
        done = await self._call(lambda c: self._write_missing(c, keys, values), _UNREACHED)
        if done is _UNREACHED:
            return [False] * len(keys)
        if done is None:
            return await super()._put_missing(keys, values)
        stored: list[bool] = done
        self._count("puts", sum(stored))
        return stored

    def _write_missing(
        self, client: MooncakeClient, keys: list[str], values: list[list[memoryview]]
    ) -> list[bool] | None:
        codes = client.put_missing(self._mkeys(keys), values)
        if codes is None:
            return None
        self._failed(codes, "put")
        return [rc == OK for rc in codes]

    async def _delete(self, keys: list[str]) -> list[bool]:
        # Forced: a cache delete must take effect even while a reader holds the object's lease.
        return await self._object_or_marker(
            keys, lambda s, m: s.batch_remove(m, True), OK, "delete"
        )

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        admin = self.config.admin_url
        if admin is None:
            raise ConfigError(
                "this mooncake backend cannot list objects: add admin_url=http://HOST:PORT "
                "(the master's --metrics_port) to its URL"
            )
        infos = await asyncio.to_thread(list_objects, admin, self.config.key_prefix + prefix)
        cut = len(self.config.key_prefix)
        listed_at = time.time()  # Mooncake keeps no write times
        for mkey, size in infos:
            yield ObjectInfo(mkey[cut:], size, listed_at)

    async def _stats(self) -> dict[str, int | float]:
        conn = self._conn
        client = conn.client if conn is not None else None
        if conn is None or client is None:
            return {}
        return {  # of the client, which backends with the same settings share
            "zero_copy_bytes": client.zero_copy_bytes,
            "bytes_staged": client.bytes_staged,
            "oversize_moves": client.oversize_moves,
            "registered_bytes": client.regions.nbytes,
            "staging_bytes": client.staging.nbytes,
            "rebuilds": conn.rebuilds,
        }

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        # The wait is on a thread, so the loop runs on unless Mooncake holds the GIL, which
        # its close() does: the connection closes only a client whose master answers.
        if not await asyncio.to_thread(conn.release, self.config.close_timeout_s):
            self._count("close_abandoned")

    # ----- plumbing ---------------------------------------------------------------------------
    async def _call(self, op: Callable[[MooncakeClient], T], fallback: T) -> T:
        """``op`` on the client's worker thread; ``fallback`` while the master is down."""
        conn = self._live()
        try:
            work = asyncio.get_running_loop().run_in_executor(conn.executor, conn.run, op)
            return await outlive_cancel(work)  # the op may still be moving the caller's bytes
        except Unavailable:
            self._count("unavailable")
            return fallback

    def _checked(self, codes: list[int], what: str) -> list[int] | None:
        """``codes``, or None when they say the master could not be reached (worker thread)."""
        return None if self._failed(codes, what) else codes

    def _failed(self, codes: list[int], what: str) -> bool:
        """Count and log failures among ``codes``; True if the master could not be reached.

        Runs on the worker thread: the gate is only ever touched there.
        """
        conn = self._live()
        lost = sum(rc in CONNECTION_CODES for rc in codes)
        if lost:
            conn.gate.failed(time.monotonic())
            self._count("rpc_errors", lost)
            conn.log.warning("rpc", "mooncake %s: master %s unreachable", what, self.config.master)
            return True
        conn.gate.succeeded()
        full = sum(rc == NO_SPACE for rc in codes)
        if full:
            self._count("put_full", full)
            conn.log.warning("full", "mooncake put: the store is full (%d objects refused)", full)
        other = [rc for rc in codes if rc < 0 and rc not in (NO_SPACE, NOT_FOUND)]
        if other and what == "put":
            self._count("put_errors", len(other))
            conn.log.warning("put", "mooncake put failed with code %d", other[0])
        return False

    def _mkeys(self, keys: list[str]) -> list[str]:
        p = self.config.key_prefix
        return [p + k for k in keys] if p else list(keys)

    def _markers(self, keys: list[str]) -> list[str]:
        p = self.config.key_prefix
        return [p + k + MARKER for k in keys]

    def _live(self) -> Connection:
        if self._conn is None:
            raise BackendClosedError("the mooncake backend is closed")
        return self._conn


def _connect(cfg: MooncakeConfig) -> Connection:
    """The shared connection for ``cfg`` (blocking); typed errors say what to fix."""
    store_cls = load_store_class()
    if not reachable(cfg.master_host, cfg.master_port, timeout_s=2.0):
        raise BackendUnavailableError(
            f"no Mooncake master at {cfg.master}: start one, e.g. mooncake_master "
            f"--rpc_port={cfg.master_port} --enable_http_metadata_server=true "
            "--http_metadata_server_port=8080 (and use "
            "metadata_server=http://HOST:8080/metadata), or fix the URL"
        )
    params = setup_params(cfg)
    if cfg.protocol == "tcp":
        # Otherwise the transfer engine advertises the first NIC's address to its peers.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", params.local_hostname)
    key = (params, cfg.staging_bytes, cfg.retry_backoff_s, cfg.rebuild_after_s)
    return Connection.acquire(store_cls, key)


def setup_params(cfg: MooncakeConfig) -> SetupParams:
    """How a client for ``cfg`` is set up (resolves this host's address toward the master)."""
    return SetupParams(
        cfg.local_hostname or local_address(cfg.master_host, cfg.master_port),
        cfg.metadata_server,
        cfg.global_segment_bytes,
        cfg.local_buffer_bytes,
        cfg.protocol,
        cfg.rdma_devices,
        cfg.master,
        cfg.prefer_local_segment,
    )


def _require(client: MooncakeClient | None) -> MooncakeClient:
    if client is None:
        raise BackendUnavailableError("the mooncake client is not connected")
    return client
