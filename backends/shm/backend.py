"""``shm://name``: objects in shared memory, seen by every process on the host that opens the name.

One fixed-size arena per name (a file under ``/dev/shm``), created at the first open and
pre-faulted once, then attached by later opens; see :mod:`hicache.backends.shm.layout` for the
file and its locks and :mod:`hicache.backends.shm.index` for the index and allocator.

Protocol, so that no reader ever sees a torn object:

- put: under the lock, reserve blocks and a WRITING entry (invisible to readers); copy outside
  the lock; under the lock, publish (READY, new generation) and drop the key's older version.
  A writer that dies before publishing leaves only a WRITING entry, reclaimed by the next
  writer short of space (or the next open) once the writer's owner lock shows it is gone.
- get: under the lock, look up the entry and note its generation; copy outside the lock; under
  the lock, check the generation again. Eviction, overwrite and delete all change it, so a
  changed generation means the blocks may have been reused mid-copy: read again. After two
  such rounds the third copies under the lock, so a key present throughout never misses.

Lifetime: the segment survives ``close()`` and the exit of every process, but not a reboot
(``persistent=False``). ``unlink()``, :meth:`SharedMemoryBackend.unlink_segment` or
``unlink_on_close=True`` remove it; processes still attached keep using the unlinked copy and
the next open creates a fresh, empty segment. Do not use one opened backend across ``fork()``:
open it again in the child.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from hicache.backends._io_threads import in_thread
from hicache.backends.base import (
    MISS,
    Capabilities,
    ObjectInfo,
    StorageBackend,
    segments_nbytes,
)
from hicache.backends.shm.copies import as_arrays, plan_copy, run_copies, split_batch
from hicache.backends.shm.index import SharedIndex, Ticket, key_hash
from hicache.backends.shm.layout import Geometry, SegmentFile, segment_path
from hicache.errors import BackendClosedError, BackendError, ConfigError

__all__ = ["SharedMemoryBackend", "SharedMemoryConfig"]

T = TypeVar("T")
R = TypeVar("R")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
_DEFAULT_CAPACITY = 1 << 30
_DEFAULT_BLOCK = 64 << 10
_OPTIMISTIC_READS = 2  # lock-free read rounds before one under the lock


def _check_name(name: str) -> None:
    if not isinstance(name, str) or _NAME_RE.match(name) is None or ".." in name:
        raise ConfigError(
            f"invalid shm segment name {name!r}: 1-128 of letters, digits, '.', '_', '-', "
            "not starting with '.' or '-', no '/' and no '..'"
        )


@dataclass(frozen=True, slots=True)
class SharedMemoryConfig:
    """Where the segment lives and, when this open creates it, its size.

    ``capacity_bytes``, ``block_bytes`` and ``max_objects`` left at None take the stored values
    when the segment exists (defaults 1 GiB, 64 KiB and capacity / block when it does not); set
    explicitly, they must match an existing segment. The capacity is rounded down to whole
    blocks. Every object takes whole blocks: pick ``block_bytes`` near the typical object size.
    """

    name: str = "hicache"
    capacity_bytes: int | None = None
    block_bytes: int | None = None
    max_objects: int | None = None
    directory: str = "/dev/shm"
    unlink_on_close: bool = False
    #: A large batch is split across this many worker threads (asyncio's default executor),
    #: whose copies run in parallel since numpy releases the GIL. 1: one thread per call.
    parallel_copies: int = 2

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not 1 <= self.parallel_copies <= 64:
            raise ConfigError("SharedMemoryConfig.parallel_copies must be in [1, 64]")
        block = self.block_bytes
        if block is not None and (block < 4096 or block % 4096 or block >= 1 << 31):
            raise ConfigError("SharedMemoryConfig.block_bytes must be a multiple of 4096")
        if self.capacity_bytes is not None and self.capacity_bytes < (block or _DEFAULT_BLOCK):
            raise ConfigError("SharedMemoryConfig.capacity_bytes must hold at least one block")
        if self.max_objects is not None and not 1 <= self.max_objects < 1 << 31:
            raise ConfigError("SharedMemoryConfig.max_objects must be in [1, 2**31)")
        if not self.directory or not os.path.isabs(self.directory):
            raise ConfigError("SharedMemoryConfig.directory must be an absolute path")

    @property
    def path(self) -> str:
        return segment_path(self.directory, self.name)

    def wanted_geometry(self) -> tuple[Geometry, frozenset[str]]:
        """The geometry to create with, and which of its fields were set explicitly."""
        block = self.block_bytes or _DEFAULT_BLOCK
        n_blocks = (self.capacity_bytes or _DEFAULT_CAPACITY) // block
        geometry = Geometry(block, n_blocks, self.max_objects or n_blocks)
        explicit = {
            "block_bytes": self.block_bytes is not None,
            "capacity_bytes": self.capacity_bytes is not None,
            "max_objects": self.max_objects is not None,
        }
        return geometry, frozenset(k for k, v in explicit.items() if v)


class SharedMemoryBackend(StorageBackend):
    """``shm://name?capacity_bytes=1G``: a bounded, LRU shared-memory store for one host."""

    name = "shm"
    url_schemes = ("shm",)
    url_parts = frozenset({"host"})  # the segment name, one word: a path is refused
    capabilities = Capabilities(
        persistent=False, shared_across_processes=True, zero_copy=False, listable=True
    )
    config_type = SharedMemoryConfig

    def __init__(self, config: SharedMemoryConfig, segment: SegmentFile) -> None:
        """Use :meth:`open`; this wraps an already opened segment."""
        super().__init__()
        self.config = config
        # Larger objects can never fit; per instance, since the size comes from the segment.
        self.capabilities = replace(
            self.capabilities, max_object_bytes=segment.geometry.capacity_bytes
        )
        self._segment = segment
        self._pid = os.getpid()
        self._index = SharedIndex(segment, self._pid)
        self._data = segment.data
        self._parts = config.parallel_copies
        self._ops = 0
        self._shutting = False
        self._idle = threading.Condition()
        #: Test hook: called in the worker thread after a put's bytes are copied and before
        #: they are published, with the keys of that wave. Tests kill the process here to
        #: play a writer that dies mid-write. None in normal use.
        self.before_publish: Callable[[list[str]], None] | None = None

    @classmethod
    async def open(cls, config: SharedMemoryConfig) -> SharedMemoryBackend:
        geometry, explicit = config.wanted_geometry()
        segment = await asyncio.to_thread(SegmentFile.open, config.path, geometry, explicit)
        backend = cls(config, segment)
        try:
            await backend.reclaim_dead_writes()  # blocks left by writers that died since
        except BaseException:
            await backend.close()
            raise
        return backend

    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        return {"name": netloc} if netloc else {}

    @classmethod
    def unlink_segment(cls, name: str, directory: str = "/dev/shm") -> bool:
        """Remove the segment ``name``; True if it existed. Attached processes keep their copy."""
        _check_name(name)
        try:
            os.unlink(segment_path(directory, name))
        except FileNotFoundError:
            return False
        return True

    def unlink(self) -> bool:
        """Remove this backend's segment file (see :meth:`unlink_segment`); before or after close.

        An open backend stays usable on the unlinked copy. Synchronous: one ``unlink`` call.
        """
        return self.unlink_segment(self.config.name, self.config.directory)

    async def reclaim_dead_writes(self) -> int:
        """Free blocks reserved by writers that died before publishing; how many were freed."""
        return await self._call(self._reclaim_sync)

    # ----- the contract -----------------------------------------------------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self._call(self._exists_sync, keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        sizes = [segments_nbytes(b) for b in buffers]
        return await self._in_parts(self._get_sync, keys, buffers, split_batch(sizes, self._parts))

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        capacity = self._segment.geometry.capacity_bytes
        sizes = [segments_nbytes(v) for v in values]
        fits = [n <= capacity for n in sizes]
        self._count("put_too_large", fits.count(False))
        todo = [i for i, ok in enumerate(fits) if ok]
        if not todo:
            return fits
        # Parts reserve space independently, so split only batches that fit with room to
        # spare: a batch near the capacity keeps one thread, and the LRU order of one stream.
        fitting = sum(sizes[i] for i in todo) <= capacity // 2
        parts = split_batch([sizes[i] for i in todo], self._parts if fitting else 1)
        stored = await self._in_parts(
            self._put_sync, [keys[i] for i in todo], [values[i] for i in todo], parts
        )
        results = [False] * len(keys)
        for i, ok in zip(todo, stored, strict=True):
            results[i] = ok
        return results

    async def _in_parts(
        self,
        fn: Callable[[list[str], list[list[memoryview]]], list[R]],
        keys: list[str],
        buffers: list[list[memoryview]],
        parts: list[range],
    ) -> list[R]:
        """``fn`` over the batch, one worker thread per part, results in key order."""
        if len(parts) <= 1:
            return await self._call(fn, keys, buffers)
        done = await asyncio.gather(
            *(self._call(fn, keys[p.start : p.stop], buffers[p.start : p.stop]) for p in parts)
        )
        return [r for part in done for r in part]

    async def _delete(self, keys: list[str]) -> list[bool]:
        return await self._call(self._delete_sync, keys)

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        # A snapshot taken under the lock, so puts and deletes while the caller iterates are safe.
        for info in await self._call(self._scan_sync, prefix):
            yield info

    async def _stats(self) -> dict[str, int | float]:
        return await self._call(self._stats_sync)

    async def _close(self) -> None:
        await asyncio.to_thread(self._close_sync)

    # ----- work done in threads ----------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await in_thread(self._guarded, fn, *args)

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        # Counted in the worker thread itself, so close() waits for every copy into the mapping
        # that has started, even if the awaiting task was cancelled.
        with self._idle:
            if self._shutting:
                raise BackendClosedError("SharedMemoryBackend is closed")
            if os.getpid() != self._pid:
                raise BackendError("this shm backend was opened before fork(); open it again")
            self._ops += 1
        try:
            return fn(*args)
        finally:
            with self._idle:
                self._ops -= 1
                self._idle.notify_all()

    def _exists_sync(self, keys: list[str]) -> list[bool]:
        raw = [k.encode() for k in keys]
        with self._index.locked():
            return [self._index.find(k, key_hash(k)) >= 0 for k in raw]

    def _delete_sync(self, keys: list[str]) -> list[bool]:
        raw = [k.encode() for k in keys]
        with self._index.locked():
            return [self._index.remove(k, key_hash(k)) for k in raw]

    def _scan_sync(self, prefix: str) -> list[ObjectInfo]:
        with self._index.locked():
            return self._index.listing(prefix)

    def _stats_sync(self) -> dict[str, int | float]:
        with self._index.locked():
            return self._index.counters()

    def _reclaim_sync(self) -> int:
        with self._index.locked():
            return self._index.reclaim_dead()

    def _get_sync(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        raw = [(k.encode(), key_hash(k.encode())) for k in keys]
        results = [MISS] * len(keys)
        pending = list(range(len(keys)))
        # Optimistic rounds copy outside the lock; an object overwritten or evicted mid-copy
        # is read again. The last round copies under the lock, so a key that exists
        # throughout is never reported missing however busy its writers are.
        for attempt in range(_OPTIMISTIC_READS + 1):
            pending = self._read_round(raw, pending, buffers, results, attempt)
            if not pending:
                break
        return results

    def _read_round(
        self,
        raw: list[tuple[bytes, int]],
        pending: list[int],
        buffers: list[list[memoryview]],
        results: list[int],
        attempt: int,
    ) -> list[int]:
        """Look up, copy and re-check ``pending``; the ones whose bytes changed meanwhile."""
        index = self._index
        copied: list[tuple[int, Ticket]] = []
        plan: list[tuple[np.ndarray, np.ndarray]] = []
        with index.locked():
            for i in pending:
                ticket = index.open_read(*raw[i])
                results[i] = MISS if ticket is None else ticket.size
                if ticket is not None and ticket.size <= segments_nbytes(buffers[i]):
                    plan_copy(self._pieces(ticket), as_arrays(buffers[i]), plan)
                    copied.append((i, ticket))
            if attempt == _OPTIMISTIC_READS:
                run_copies(plan)  # nothing can change under the lock
                return []
        run_copies(plan)
        with index.locked():
            torn = [i for i, ticket in copied if not index.valid(ticket)]
            if torn:
                index.count_torn(len(torn))
        for i in torn:
            results[i] = MISS
        return torn

    def _put_sync(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        results = [False] * len(keys)
        todo = list(range(len(keys)))
        while todo:
            wave, todo = self._reserve_wave(keys, values, todo, results)
            if wave:
                self._fill_and_publish(keys, values, wave, results)
        return results

    def _reserve_wave(
        self,
        keys: list[str],
        values: list[list[memoryview]],
        todo: list[int],
        results: list[bool],
    ) -> tuple[list[tuple[int, Ticket]], list[int]]:
        """Reserve space for as many of ``todo`` as fit; the rest wait for the next wave.

        When the batch is larger than the free space, the wave reserved so far is published
        before going on, so that later objects can evict earlier ones (as an LRU store would).
        """
        wave: list[tuple[int, Ticket]] = []
        with self._index.locked():
            for pos, i in enumerate(todo):
                raw = keys[i].encode()
                ticket = self._index.reserve(raw, key_hash(raw), segments_nbytes(values[i]))
                if ticket is not None:
                    wave.append((i, ticket))
                elif wave:
                    return wave, todo[pos:]
                else:
                    results[i] = False  # no room even with everything evictable evicted
        return wave, []

    def _fill_and_publish(
        self,
        keys: list[str],
        values: list[list[memoryview]],
        wave: list[tuple[int, Ticket]],
        results: list[bool],
    ) -> None:
        try:
            plan: list[tuple[np.ndarray, np.ndarray]] = []
            for i, ticket in wave:
                plan_copy(as_arrays(values[i]), self._pieces(ticket), plan)
            run_copies(plan)
            if self.before_publish is not None:
                self.before_publish([keys[i] for i, _ in wave])
        except BaseException:
            with self._index.locked():
                for _, ticket in wave:
                    self._index.abandon(ticket)
            raise
        with self._index.locked():
            for i, ticket in wave:
                results[i] = self._index.publish(ticket)

    def _pieces(self, ticket: Ticket) -> list[np.ndarray]:
        data = self._data
        return [data[off : off + n] for off, n in ticket.extents]

    def _close_sync(self) -> None:
        with self._idle:
            self._shutting = True
            self._idle.wait_for(lambda: self._ops == 0)
        # The numpy views must go before the mapping can be unmapped.
        del self._data, self._index
        self._segment.close()
        if self.config.unlink_on_close:
            self.unlink_segment(self.config.name, self.config.directory)
