"""``nixl://``: objects moved by a NIXL agent, as files (POSIX plugin) or S3 objects (OBJ plugin).

URLs::

    nixl:///var/cache/kv?plugin=posix&fsync=true
    nixl://bucket/prefix?plugin=obj&endpoint_url=http://127.0.0.1:9000&access_key=...&secret_key=...

POSIX: one file per key under the root, written through NIXL FILE transfers into a hidden
temporary file, optionally fsynced, then renamed, so readers in any process see the old object
or the new one, never a mix. OBJ: one S3 object per key under ``prefix/``; an S3 PUT is atomic.

Memory: NIXL moves data only from and to registered memory. A host pool calls
:meth:`NixlBackend.register_memory` once for its whole buffer; a transfer whose segments lie
inside registered memory then goes straight from or to them (counted as ``zero_copy_bytes``).
Other segments are copied through a staging region registered once at open (``bytes_staged``),
and so are multi-segment values in OBJ mode, where an object moves as one descriptor.

Transfers: a batch of up to ``batch_keys`` objects moves in one NIXL transfer, submitted and
polled on a worker thread (see ``agent``), so the event loop never waits on NIXL.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote

from hicache.backends._io_threads import in_thread
from hicache.backends._prepared_open import PreparedInThread
from hicache.backends.base import MISS, Capabilities, ObjectInfo, segments_nbytes
from hicache.backends.nixl.agent import (
    NixlAgent,
    NixlPluginError,
    RegisteredMemory,
    Staging,
    load_nixl_api,
)
from hicache.backends.nixl.stores import ObjStore, PosixStore, Target
from hicache.backends.nixl.transfer import Job, Mover
from hicache.errors import BackendUnavailableError, ConfigError

__all__ = [
    "QUEUE_PARAMS",
    "NixlBackend",
    "NixlConfig",
    "NixlPlugin",
    "NixlPluginError",
    "PosixQueue",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NixlPlugin(enum.Enum):
    """The NIXL storage plugin: where objects live."""

    POSIX = "posix"  # files under a local or shared directory
    OBJ = "obj"  # objects in an S3 bucket


class PosixQueue(enum.Enum):
    """The POSIX plugin's I/O queue. All are correct; speed differs by kernel and filesystem."""

    AIO = "aio"  # Linux AIO: buffered I/O runs synchronously inside transfer()
    URING = "uring"
    POSIX_AIO = "posix_aio"  # glibc's thread pool: measured fastest on buffered files here


_SESSION_LOCK = threading.Lock()
_botocore_session: Any = None

# The POSIX plugin's parameters that choose each queue (the raw NIXL bench passes them too).
QUEUE_PARAMS = {
    PosixQueue.AIO: {},
    PosixQueue.URING: {"use_uring": "true"},
    PosixQueue.POSIX_AIO: {"use_posix_aio": "true"},
}


@dataclass(frozen=True, slots=True)
class NixlConfig:
    """Options of a ``nixl://`` URL; credentials never appear in ``repr``."""

    path: str = ""  # POSIX: the store's directory; OBJ: the key prefix inside the bucket
    bucket: str = ""  # OBJ only: the URL's host part
    plugin: NixlPlugin = NixlPlugin.POSIX
    fsync: bool = False  # POSIX: fsync each file before its rename and the directory after
    posix_queue: PosixQueue = PosixQueue.POSIX_AIO
    staging_bytes: int = 64 << 20  # registered bounce buffer for unregistered segments
    batch_keys: int = 32  # objects per NIXL transfer
    endpoint_url: str | None = None  # OBJ: http(s)://host:port; None for AWS
    region: str = "us-east-1"
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.staging_bytes <= 0 or self.batch_keys <= 0:
            raise ConfigError("NixlConfig.staging_bytes and batch_keys must be positive")
        if self.plugin is NixlPlugin.POSIX:
            if self.bucket not in ("", "localhost"):
                raise ConfigError(
                    f"a nixl POSIX URL names a local path (nixl:///abs/path), not {self.bucket!r}"
                )
            if not self.path:
                raise ConfigError("nixl POSIX needs a directory, e.g. nixl:///var/cache/kv")
        elif not self.bucket:
            raise ConfigError("nixl OBJ needs a bucket: nixl://bucket/prefix?plugin=obj")
        if self.plugin is NixlPlugin.POSIX:
            # Absolute once and for all: a later chdir in the process must not move the store.
            object.__setattr__(self, "path", os.path.abspath(os.path.expanduser(self.path)))
        if (self.access_key is None) != (self.secret_key is None):
            raise ConfigError("give both access_key and secret_key, or neither")

    @property
    def prefix(self) -> str:
        return self.path.strip("/")


class NixlBackend(PreparedInThread):
    """Objects in files or S3, moved by NIXL; zero-copy from memory given to register_memory."""

    name = "nixl"
    url_schemes = ("nixl",)
    url_parts = frozenset({"host", "path"})  # bucket and prefix (OBJ) or a directory (POSIX)
    capabilities = Capabilities(
        persistent=True, shared_across_processes=True, zero_copy=True, listable=True
    )
    config_type = NixlConfig

    def __init__(self, config: NixlConfig) -> None:
        super().__init__()
        self.config = config
        self._agent: NixlAgent | None = None
        self._store: PosixStore | ObjStore | None = None
        self._registered: RegisteredMemory | None = None
        self._mover: Mover | None = None
        self._read_errors = 0
        self._errors_lock = threading.Lock()  # read errors are noted on worker threads too

    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        return {"bucket": netloc, "path": unquote(path)}

    def _prepare(self) -> None:
        """Start the agent and its plugin, register the staging region, check the store."""
        cfg = self.config
        api = load_nixl_api()
        if cfg.plugin is NixlPlugin.POSIX:
            agent = NixlAgent(api, "POSIX", dict(QUEUE_PARAMS[cfg.posix_queue]))
            store: PosixStore | ObjStore = PosixStore(cfg.path, cfg.fsync)
        else:
            client = _s3_client(cfg)
            try:
                agent = NixlAgent(api, "OBJ", _obj_params(cfg))
            except BaseException:
                client.close()
                raise
            store = ObjStore(agent, client, cfg.bucket, cfg.prefix)
        try:
            store.prepare()
            staging = Staging(agent, cfg.staging_bytes)
        except BaseException:
            store.close()
            agent.close()
            raise
        self._agent, self._store = agent, store
        self._registered = RegisteredMemory(agent)
        self._mover = Mover(agent, self._registered, staging)

    # ----- registered memory ----------------------------------------------------------------
    def register_memory(self, buffer: Any) -> bool:
        """Register a host buffer once; transfers from or to it then skip the staging copy.

        Call it at setup (a host pool's whole buffer). The buffer must stay alive and
        unchanged in size until :meth:`unregister_memory` or close. False when it already lies
        inside registered memory. Registration only records the region in these plugins
        (no pinning), so this is quick enough to call from the event loop.
        """
        self._check_open()
        assert self._registered is not None
        return self._registered.add(buffer)

    def unregister_memory(self, buffer: Any) -> bool:
        """Undo :meth:`register_memory` for the same buffer; False if it was not registered."""
        self._check_open()
        assert self._registered is not None
        return self._registered.remove(buffer)

    # ----- operations -----------------------------------------------------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        assert self._store is not None
        return await self._in_thread(self._store.exists_many, keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        step = self.config.batch_keys
        results: list[int] = []
        for lo in range(0, len(keys), step):
            chunk = keys[lo : lo + step]
            if isinstance(self._store, ObjStore):
                await self._learn_sizes(self._store, chunk)
            results += await self._in_thread(self._get_chunk, chunk, buffers[lo : lo + step])
        return results

    async def _learn_sizes(self, store: ObjStore, keys: list[str]) -> None:
        """HEAD, concurrently, the keys whose size this process does not know yet."""
        unknown = sorted({k for k in keys if store.known_size(k) is None})
        outcomes = await asyncio.gather(
            *(asyncio.to_thread(store.head, k) for k in unknown), return_exceptions=True
        )
        failed = [o for o in outcomes if isinstance(o, Exception)]
        if failed:  # such a key reads as a miss: a cache that cannot reach S3 degrades
            self._note_read_errors(len(failed), str(failed[0]))

    def _get_chunk(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        store, mover = self._store, self._mover
        assert store is not None and mover is not None
        targets: list[Target | None] = []
        results: list[int] = []
        jobs: list[tuple[int, Job]] = []
        try:
            for key, segs in zip(keys, buffers, strict=True):
                try:
                    target = store.begin_read(key)
                except OSError as exc:  # unreadable (permissions, I/O): a miss, counted
                    self._note_read_errors(1, f"{key!r}: {exc.strerror}")
                    target = None
                targets.append(target)
                results.append(MISS if target is None else target.size)
                if target is not None and target.size <= segments_nbytes(segs):
                    jobs.append((len(results) - 1, Job(target, segs)))
            self._move("READ", [job for _, job in jobs])
            failed = [i for i, job in jobs if not job.ok]
            for i in failed:
                results[i] = MISS
            if failed:
                self._note_read_errors(len(failed), "a NIXL read transfer failed")
        finally:  # a failed read drops what the store believed about the key
            for i, target in enumerate(targets):
                if target is not None:
                    store.end_read(target, i < len(results) and results[i] >= 0)
        return results

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        step = self.config.batch_keys
        results: list[bool] = []
        for lo in range(0, len(keys), step):
            results += await self._in_thread(
                self._put_chunk, keys[lo : lo + step], values[lo : lo + step]
            )
        return results

    def _put_chunk(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        store = self._store
        assert store is not None
        jobs: list[Job | None] = []
        try:
            for key, segs in zip(keys, values, strict=True):
                try:
                    jobs.append(Job(store.begin_write(key, segments_nbytes(segs)), segs))
                except OSError as exc:  # no space, too many files: this key fails
                    logger.debug("nixl put of %r could not start: %s", key, exc)
                    jobs.append(None)
            self._move("WRITE", [job for job in jobs if job is not None])
        finally:
            results = [
                False if job is None else store.end_write(job.target, job.ok) for job in jobs
            ]
        return results

    def _move(self, op: str, jobs: list[Job]) -> None:
        """Register the jobs' targets, move them, deregister; a failure leaves ``ok`` False."""
        store, agent, mover = self._store, self._agent, self._mover
        assert store is not None and agent is not None and mover is not None
        regions = [job.target.region for job in jobs if job.target.size > 0]
        handle = None
        try:
            if regions:
                handle = agent.register(regions, store.remote_mem)
            mover.run(op, jobs, store.remote_mem, one_piece=isinstance(store, ObjStore))
        except Exception as exc:  # registration refused, plugin error: these jobs fail
            logger.warning("NIXL %s of %d objects failed: %s", op, len(jobs), exc)
            for job in jobs:
                job.ok = False
        finally:
            if handle is not None:
                agent.deregister(handle)

    async def _delete(self, keys: list[str]) -> list[bool]:
        assert self._store is not None
        return await self._in_thread(self._store.delete_many, keys)

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        assert self._store is not None
        for info in await asyncio.to_thread(self._store.scan, prefix):
            yield info

    async def _stats(self) -> dict[str, int | float]:
        assert self._mover is not None and self._registered is not None
        out: dict[str, int | float] = dict(self._mover.snapshot())
        out.update(
            read_errors=self._read_errors,
            registered_bytes=self._registered.nbytes,
            staging_bytes=self.config.staging_bytes,
        )
        return out

    async def _close(self) -> None:
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        if self._registered is not None:
            self._registered.clear()
        if self._mover is not None:
            self._mover.staging.close()
        if self._store is not None:
            self._store.close()
        if self._agent is not None:
            self._agent.close()
        self._agent = self._store = self._registered = self._mover = None

    # ----- helpers ----------------------------------------------------------------------------
    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread; a cancelled caller still waits for it to finish."""
        return await in_thread(fn, *args)

    def _note_read_errors(self, count: int, detail: str) -> None:
        with self._errors_lock:
            first = self._read_errors == 0
            self._read_errors += count
        logger.log(logging.WARNING if first else logging.DEBUG, "nixl read failed: %s", detail)


def _obj_params(cfg: NixlConfig) -> dict[str, str]:
    params = {"bucket": cfg.bucket, "region": cfg.region, "req_checksum": "supported"}
    if cfg.access_key is not None and cfg.secret_key is not None:
        params.update(access_key=cfg.access_key, secret_key=cfg.secret_key)
    if cfg.endpoint_url:
        scheme, _, host = cfg.endpoint_url.partition("://")
        if not host:
            raise ConfigError(
                f"NixlConfig.endpoint_url must be http://host:port or https://host:port, "
                f"got {cfg.endpoint_url!r}"
            )
        # A local endpoint (moto, MinIO) serves buckets by path, not as subdomains.
        params.update(endpoint_override=cfg.endpoint_url, scheme=scheme)
        params["use_virtual_addressing"] = "false"
    return params


def _s3_client(cfg: NixlConfig) -> Any:
    global _botocore_session
    try:
        import botocore.session
    except ImportError:
        raise BackendUnavailableError(
            "nixl OBJ mode needs botocore for sizes, deletes and listings: "
            "pip install 'hicache[s3]'"
        ) from None
    # One session per process: making one loads botocore's service models (about 0.3 s);
    # clients made from it are independent. create_client is not documented thread-safe.
    with _SESSION_LOCK:
        if _botocore_session is None:
            _botocore_session = botocore.session.get_session()
        return _botocore_session.create_client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            region_name=cfg.region,
            aws_access_key_id=cfg.access_key,
            aws_secret_access_key=cfg.secret_key,
        )
