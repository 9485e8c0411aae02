"""LMCache's ``RemoteConnector`` over any hicache storage backend.

Every async method runs on LMCache's storage event loop (the loop the connector was built
with), where the backend was opened; the blocking ones (``exists_sync``, ``batched_contains``,
``remove_sync``), which LMCache calls from its own threads, hand a coroutine to that loop and
wait for it, up to LMCache's ``blocking_timeout_secs``.

Each chunk is one hicache page: the codec's header, then the chunk's bytes. A write hands the
header and a view of the memory object to the backend as two segments, and a read lands the
header in a small buffer and the payload straight in a memory object allocated from LMCache's
local CPU backend: no join copy either way. A page that is missing, corrupt, truncated, of
another format or stored under another name is a miss (counted and logged), never wrong KV
and never an exception out of a read.

A chunk whose put is still in flight is not stored yet: lookups answer for it from the
connector's own list of puts in flight, without asking the backend. LMCache polls its lookup
while its writes run in the background; those polls then cost no round trip to the store and
no turn on the storage loop while the put they wait for is using it. (A chunk stored before and
being stored again reads as a miss for that moment: a miss, never wrong KV.)
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.segments import byte_runs
from hicache.codec import HEADER_SIZE, check_into, encode_page, payload_checked_by
from hicache.errors import (
    BackendError,
    BackendUnavailableError,
    CodecError,
    ConfigError,
    HiCacheError,
    InvalidArgumentError,
)
from hicache.integrations.lmcache.names import KeyNames
from hicache.integrations.lmcache.pages import ChunkPages
from hicache.page_header import PageMeta

__all__ = [
    "PUT_GROUP_BYTES",
    "HiCacheConnector",
    "LMCacheConfigError",
    "run_on_loop",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: A chunk's bytes and its page meta, as a put encodes them.
Chunk = tuple[memoryview, PageMeta]
#: The payload bytes of a group of a large put: its checksums run while the group before it is
#: stored. 64 chunks of 8 MiB in one group (inside ``bench lmcache``): 36 ms of a 168 ms put
#: went to encoding, all before the backend began. Two of LMCache's 32 MiB chunks to a group, so
#: that ``disk://`` writes each group with both its lanes (``backends/disk/lanes.py``): put over
#: LMCache's at 32 MiB went from 0.66 to 0.82 with that (8 rounds each), and at 8 MiB, 1.05 to 1.20.
PUT_GROUP_BYTES = 64 << 20


class LMCacheConfigError(ConfigError, IrrecoverableException):  # type: ignore[misc]
    """A hicache plugin configuration LMCache cannot run with (bad URL, unsupported option).

    Also an LMCache ``IrrecoverableException``: LMCache's ``RemoteBackend.init_connection``
    re-raises those, where any other error is logged as a warning and the connection retried
    every 10 s for ever; a wrong URL does not get better by waiting.
    """


def run_on_loop(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout_s: float
) -> T:
    """Run ``coro`` on ``loop`` (run by another thread) and wait for its result.

    A timeout cancels it and raises :class:`BackendUnavailableError`. Called on ``loop``'s own
    thread it would wait on itself for ever, so it refuses.
    """
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise InvalidArgumentError(
            "a blocking hicache connector call on LMCache's storage loop would wait on itself"
        )
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise BackendUnavailableError(
            f"the hicache backend did not answer within {timeout_s:g} s"
        ) from None


class HiCacheConnector(RemoteConnector):  # type: ignore[misc]  # LMCache ships no types
    """Stores LMCache chunks as hicache pages in ``backend`` (opened on ``loop``).

    ``builtins.list`` in annotations: LMCache's interface names a method ``list``, which
    shadows the builtin inside the class.
    """

    _backend: StorageBackend
    _pages: ChunkPages
    _names: KeyNames
    _counters: dict[str, int]
    _timeout_s: float
    _storing: dict[str, int]

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
        backend: StorageBackend,
    ) -> None:
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._backend = backend
        self._timeout_s = float(config.blocking_timeout_secs)
        try:
            self._pages = ChunkPages(
                self.meta_fmt.name, self.meta_fmt.token_dim(), self.meta_shapes, self.meta_dtypes
            )
        except ConfigError as exc:
            raise LMCacheConfigError(str(exc)) from exc
        self._names = KeyNames(self._pages.tag)
        self._counters = dict.fromkeys(
            ("hits", "misses", "bad_pages", "read_errors", "alloc_failures", "put_failures"), 0
        )
        # Names with a put in flight, and how many puts of each. Written on the loop; read
        # from LMCache's lookup threads (a dict lookup is atomic under the GIL).
        self._storing = {}

    def __repr__(self) -> str:
        return f"<HiCacheConnector {type(self._backend).__name__} {self._names.prefix}*>"

    @property
    def backend(self) -> StorageBackend:
        return self._backend

    def storage_name(self, key: CacheEngineKey) -> str:
        """The hicache key ``key`` is stored under."""
        return self._names.name(key.to_string())

    def stats(self) -> dict[str, int]:
        """Reads that hit or missed, pages refused as bad, failed reads, allocations, puts."""
        return dict(self._counters)

    # ----- lookups ----------------------------------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        name = self.storage_name(key)
        return name not in self._storing and (await self._backend.exists([name]))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        if self.storage_name(key) in self._storing:
            return False
        return run_on_loop(self.loop, self.exists(key), self._timeout_s)

    async def batched_async_contains(
        self, lookup_id: str, keys: Sequence[CacheEngineKey], pin: bool = False
    ) -> int:
        """How many keys from the first are stored, without a gap (``pin`` has no meaning)."""
        names = self._until_storing(keys)
        return await self._backend.leading_hits(names) if names else 0

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> int:
        names = self._until_storing(keys)
        if not names:
            return 0
        return run_on_loop(self.loop, self._backend.leading_hits(names), self._timeout_s)

    def _until_storing(self, keys: Sequence[CacheEngineKey]) -> builtins.list[str]:
        """The keys' names up to the first one whose put is in flight (the lookup's answer
        cannot go past it)."""
        names: builtins.list[str] = []
        for key in keys:  # name by name: a poll during a put stops at the first, in flight
            name = self.storage_name(key)
            if name in self._storing:
                break
            names.append(name)
        return names

    # ----- reads ------------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> builtins.list[MemoryObj | None]:
        """One memory object per key, None for a miss; one backend call for the batch."""
        names = self._names_of(keys)
        objs: builtins.list[MemoryObj] = []
        try:
            for _ in names:
                obj = self._allocate()
                if obj is None:  # memory pressure: this key and the rest are misses
                    self._counters["alloc_failures"] += 1
                    break
                objs.append(obj)
            headers = [bytearray(HEADER_SIZE) for _ in objs]
            buffers = [[header, obj.byte_array] for header, obj in zip(headers, objs)]
            sizes = await self._backend.get_into(names[: len(objs)], buffers)
        except (HiCacheError, OSError) as exc:
            # A failed read is a miss for LMCache, which would otherwise count a failed get.
            _release(objs)
            self._counters["read_errors"] += 1
            logger.warning("hicache read of %d chunks failed: %s", len(names), exc)
            return [None] * len(keys)
        except BaseException:
            _release(objs)  # cancelled: the backend has stopped writing into them
            raise
        found = [
            self._accept(name, header, obj, size)
            for name, header, obj, size in zip(names, headers, objs, sizes)
        ]
        return found + [None] * (len(keys) - len(found))

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: Sequence[CacheEngineKey]
    ) -> builtins.list[MemoryObj]:
        """The found chunks up to the first miss; the ones after it are released."""
        found = await self.batched_get(keys)
        prefix: builtins.list[MemoryObj] = []
        for obj in found:
            if obj is None:
                break
            prefix.append(obj)
        _release([obj for obj in found[len(prefix) :] if obj is not None])
        return prefix

    def _allocate(self) -> MemoryObj | None:
        # busy_loop=False: waiting for memory would sleep on the storage loop, stalling every
        # other transfer (lmcache/v1/storage_backend/local_cpu_backend.py, allocate).
        return self.local_cpu_backend.allocate(
            self.meta_shapes, self.meta_dtypes, self.meta_fmt, eviction=True, busy_loop=False
        )

    def _accept(self, name: str, header: bytearray, obj: MemoryObj, size: int) -> MemoryObj | None:
        """``obj`` if the page read into it checks out, else None (and ``obj`` released)."""
        if size == MISS:
            self._counters["misses"] += 1
            obj.ref_count_down()
            return None
        payload_len = size - HEADER_SIZE
        try:
            if payload_len > self._pages.full_bytes:
                raise InvalidArgumentError(f"{name}: {size} bytes, more than a chunk's page")
            expected = self._pages.expected(payload_len)
            checked = payload_checked_by(self._backend.capabilities.checks_pages_over, size)
            check_into(name, header, obj.byte_array, size, expected, checked)
        except (CodecError, InvalidArgumentError) as exc:
            self._counters["bad_pages"] += 1
            logger.warning("hicache page refused, read as a miss: %s: %s", type(exc).__name__, exc)
            obj.ref_count_down()
            return None
        self._counters["hits"] += 1
        if payload_len == self._pages.full_bytes:
            return obj
        return self.reshape_partial_chunk(obj, payload_len)

    # ----- writes -----------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(
        self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]
    ) -> None:
        """Store each chunk as a page; raises :class:`BackendError` if any was not stored (or
        the codec's :class:`InvalidArgumentError` for a chunk whose bytes do not match its
        shape and dtype: the groups before it are stored).

        A batch of more than :data:`PUT_GROUP_BYTES` goes to the backend in groups of about
        that size, each encoded (the page checksum over its bytes) on a worker thread while the
        backend stores the group before it. LMCache's wrapper releases the memory objects once
        this returns, and the backend has copied what it needs by then. LMCache logs and counts
        a raised error; nothing is retried, a chunk not stored is a later miss.
        """
        chunks: dict[str, Chunk] = {}  # a repeated key is written once
        for key, obj in zip(keys, memory_objs, strict=True):
            chunks[self.storage_name(key)] = (obj.byte_array, self._meta_of(obj))
        names = list(chunks)
        for name in names:
            self._storing[name] = self._storing.get(name, 0) + 1
        try:
            stored = await self._store_in_groups(list(chunks.items()))
        finally:
            for name in names:
                left = self._storing.pop(name) - 1
                if left:
                    self._storing[name] = left
        failed = [name for name, ok in zip(names, stored) if not ok]
        if failed:
            self._counters["put_failures"] += len(failed)
            raise BackendError(
                f"{len(failed)} of {len(names)} chunks not stored ({failed[0]}, ...)"
            )

    async def _store_in_groups(
        self, chunks: builtins.list[tuple[str, Chunk]]
    ) -> builtins.list[bool]:
        """Each group encoded, then put while the next one is encoded; the puts' answers."""
        sizes = [view.nbytes for _, (view, _) in chunks]
        groups = [chunks[run.start : run.stop] for run in byte_runs(sizes, PUT_GROUP_BYTES)]
        if len(groups) == 1:  # one put, encoded here: no thread hop for a small batch
            return await self._backend.put([n for n, _ in chunks], _encoded(chunks))
        loop = asyncio.get_running_loop()
        stored: builtins.list[bool] = []
        puts: builtins.list[asyncio.Task[builtins.list[bool]]] = []
        try:
            for group in groups:
                pages = await asyncio.to_thread(_encoded, group)  # xxh3 lets the GIL go
                if puts:
                    stored += await puts[-1]
                puts.append(loop.create_task(self._backend.put([n for n, _ in group], pages)))
            stored += await puts[-1]
            return stored
        except asyncio.CancelledError:
            for put in puts:
                put.cancel()
            raise
        finally:  # no put outlives the call; after a failed encoding, the one in flight ends
            await asyncio.gather(*puts, return_exceptions=True)

    def _meta_of(self, obj: MemoryObj) -> Any:
        meta = obj.metadata
        fmt = obj.get_memory_format().name
        if meta.shapes is not None and len(meta.shapes) > 1:
            return self._pages.meta(fmt, meta.shapes, meta.dtypes or [])
        # One group: meta.shape is what the tensor view uses (a last chunk's token count).
        return self._pages.meta(fmt, [meta.shape], [meta.dtype])

    # ----- listing, removal, close ------------------------------------------------------------
    async def list(self) -> builtins.list[str]:
        """The key strings (``CacheEngineKey.to_string()``) of this format's stored chunks.

        Keys too long to escape are stored under a digest and cannot be listed; they are
        counted in a log line.
        """
        keys: builtins.list[str] = []
        unlisted = 0
        async for info in self._backend.scan(self._names.prefix):
            key = self._names.key_of(info.key)
            if key is not None:
                keys.append(key)
            elif self._names.is_digest(info.key):
                unlisted += 1
        if unlisted:
            logger.info("hicache list: %d chunks with keys too long to list", unlisted)
        return keys

    def remove_sync(self, key: CacheEngineKey) -> bool:
        deleted = run_on_loop(
            self.loop, self._backend.delete([self.storage_name(key)]), self._timeout_s
        )
        return deleted[0]

    async def close(self) -> None:
        await self._backend.close()

    def _names_of(self, keys: Sequence[CacheEngineKey]) -> builtins.list[str]:
        return [self._names.name(key.to_string()) for key in keys]


def _encoded(chunks: list[tuple[str, Chunk]]) -> list[list[bytes | memoryview]]:
    return [encode_page(name, view, meta) for name, (view, meta) in chunks]


def _release(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.ref_count_down()
