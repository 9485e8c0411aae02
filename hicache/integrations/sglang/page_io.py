"""Page reads and writes between SGLang host pools and a hicache backend.

Called from SGLang's prefetch and backup threads; every backend call runs on the adapter's
:class:`~hicache.integrations.sync_loop.SyncLoop`, one batched coroutine per engine call. Pages
move as scatter-gather segments straight between the backend and the pool's memory: the
codec's header in a small buffer, then the page's contiguous runs. What fails a check is a miss,
remembered so that the next backup of that page rewrites it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.backends.base import StorageBackend
from hicache.backends.registered_memory import MemoryRegistrar
from hicache.codec import HEADER_SIZE
from hicache.errors import CodecError, HiCacheError, InvalidKeyError
from hicache.integrations.page_runs import check_runs, contiguous_runs, encode_runs
from hicache.integrations.sglang.pools import PoolBinding
from hicache.integrations.sync_loop import SyncLoop

__all__ = ["IoStats", "PageIo"]

log = logging.getLogger("hicache.integrations.sglang")
# A batch of puts is split so that checksums overlap the writes: at most this many chunks, each
# at least this large.
_MAX_PUT_CHUNKS = 2
_MIN_PUT_CHUNK_BYTES = 8 << 20


@dataclass
class IoStats:
    """Per-call figures SGLang's storage metrics take (pages per call, GB/s), drained on read."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, reading: bool, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        rate = nbytes / max(seconds, 1e-9) / 1e9
        with self.lock:
            (self.prefetch_pgs if reading else self.backup_pgs).append(pages)
            (self.prefetch_bandwidth if reading else self.backup_bandwidth).append(rate)

    def drain(self) -> tuple[list[int], list[int], list[float], list[float]]:
        with self.lock:
            out = (
                self.prefetch_pgs,
                self.backup_pgs,
                self.prefetch_bandwidth,
                self.backup_bandwidth,
            )
            self.prefetch_pgs, self.backup_pgs = [], []
            self.prefetch_bandwidth, self.backup_bandwidth = [], []
        return out


class _HeaderArenas:
    """Page headers in memory of their own, one arena per engine thread, registered with a
    backend that takes registered memory: with the pool's pages registered too, a page and
    its header then move as one object without a copy (Mooncake's scatter-gather path)."""

    def __init__(self, register: Any) -> None:
        self._register = register  # buffer -> None; None when the backend takes no registration
        self._local = threading.local()

    def slots(self, count: int) -> list[memoryview]:
        arena = getattr(self._local, "arena", None)
        if arena is None or len(arena) < count * HEADER_SIZE:
            arena = bytearray(HEADER_SIZE * max(count, 128))
            if self._register is not None:
                self._register(arena)
            self._local.arena = arena
        view = memoryview(arena)
        return [view[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(count)]


@dataclass(slots=True)
class _ReadTarget:
    """Where one page is read to: the pool's own runs, or a staging page then the pool."""

    host_index: int
    runs: list[memoryview]
    staging: Any = None


class PageIo:
    """Batched page I/O for one backend; safe to call from several engine threads at once."""

    def __init__(self, backend: StorageBackend, loop: SyncLoop, timeout_s: float) -> None:
        self.backend = backend
        self._loop = loop
        self._timeout_s = timeout_s
        self._suspect: set[str] = set()  # keys whose stored object failed its check
        self._suspect_lock = threading.Lock()
        self.stats = IoStats()
        registrar = isinstance(backend, MemoryRegistrar)
        self._headers = _HeaderArenas(self._register_memory if registrar else None)

    def register_pool_memory(self, pool: PoolBinding) -> None:
        """Register a host pool's buffer with a backend that moves registered memory without a
        copy (Mooncake, NIXL): pages then go straight between the pool and the store."""
        if isinstance(self.backend, MemoryRegistrar) and pool.buffer_bytes is not None:
            self._register_memory(pool.buffer_bytes)

    def _register_memory(self, view: Any) -> None:
        backend = self.backend
        assert isinstance(backend, MemoryRegistrar)

        async def register() -> bool:
            return backend.register_memory(view)

        async def unregister() -> bool:
            return backend.unregister_memory(view)

        try:
            if self._loop.run(register(), self._timeout_s):
                self._loop.on_close(unregister)
        except HiCacheError as exc:
            log.warning("hicache: memory not registered with the backend, staged: %s", exc)

    # ----- reads ---------------------------------------------------------------------------
    def read(
        self, pool: PoolBinding, keys: Sequence[str], host_indices: Sequence[int]
    ) -> list[bool]:
        """Read each page into the pool at its token slot; True where it arrived intact."""
        return self._read_into(pool, keys, [_read_target(pool, slot) for slot in host_indices])

    def read_flat(self, pool: PoolBinding, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        """Read each page into a caller's page tensor (SGLang's generic path)."""
        return self._read_into(pool, keys, [_ReadTarget(-1, contiguous_runs(p)) for p in pages])

    def _read_into(
        self, pool: PoolBinding, keys: Sequence[str], targets: list[_ReadTarget]
    ) -> list[bool]:
        started = time.perf_counter()
        backend_keys = _backend_keys(pool, keys)
        wanted = [i for i, key in enumerate(backend_keys) if key is not None]
        results = [False] * len(keys)
        if not wanted:
            return results
        heads = self._headers.slots(len(wanted))
        names = [str(backend_keys[i]) for i in wanted]
        buffers = [[head, *targets[i].runs] for head, i in zip(heads, wanted, strict=True)]
        sizes = self._call(self.backend.get_into(names, buffers), "read")
        if sizes is None:
            return results
        nbytes = 0
        for j, i in enumerate(wanted):
            results[i] = self._finish_read(pool, names[j], heads[j], targets[i], sizes[j])
            nbytes += sizes[j] if results[i] else 0
        self.stats.record(True, sum(results), nbytes, time.perf_counter() - started)
        return results

    def _finish_read(
        self, pool: PoolBinding, key: str, head: memoryview, target: _ReadTarget, nread: int
    ) -> bool:
        if nread < 0:
            return False
        try:
            check_runs(key, head, target.runs, nread, pool.meta)
        except CodecError as exc:
            log.warning("hicache: stored page is unusable, counted as a miss: %s", exc)
            with self._suspect_lock:
                self._suspect.add(key)
            return False
        if target.staging is not None:
            pool.store_flat(target.host_index, target.staging)
        return True

    def leading_hits(self, pool: PoolBinding, keys: Sequence[str]) -> int:
        """How many pages from the first are stored (and not known to be bad)."""
        backend_keys = _backend_keys(pool, keys)
        usable = next((i for i, key in enumerate(backend_keys) if key is None), len(keys))
        with self._suspect_lock:
            if self._suspect:
                usable = next(
                    (i for i in range(usable) if backend_keys[i] in self._suspect), usable
                )
        names = [str(key) for key in backend_keys[:usable]]
        hits = self._call(self.backend.leading_hits(names), "exists") if names else 0
        return hits or 0

    def present(self, pool: PoolBinding, keys: Sequence[str]) -> list[bool]:
        """For each page, whether it is stored and not known to be bad."""
        return self._present(_backend_keys(pool, keys))

    def _present(self, backend_keys: list[str | None]) -> list[bool]:
        names = [str(key) for key in backend_keys if key is not None]
        found = iter(self._call(self.backend.exists(names), "exists") or [False] * len(names))
        with self._suspect_lock:
            return [
                key is not None and next(found) and key not in self._suspect for key in backend_keys
            ]

    # ----- writes --------------------------------------------------------------------------
    def write(self, pool: PoolBinding, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        """Store each page (a tensor view or a flat copy) unless an intact copy is stored.

        A rank that does not write a replicated pool acknowledges without writing: its pool's
        writer stores the same bytes.
        """
        if not pool.writes:
            return [True] * len(keys)
        started = time.perf_counter()
        backend_keys = _backend_keys(pool, keys)
        present = self._present(backend_keys)
        todo = [i for i, key in enumerate(backend_keys) if key is not None and not present[i]]
        results = [bool(present[i]) for i in range(len(keys))]
        if not todo:
            return results
        names = [str(backend_keys[i]) for i in todo]
        with self._suspect_lock:
            replace = any(name in self._suspect for name in names)
        stored = self._put_pipelined(pool, names, [pages[i] for i in todo], replace)
        for i, ok in zip(todo, stored, strict=True):
            results[i] = ok
        with self._suspect_lock:
            self._suspect.difference_update(n for n, ok in zip(names, stored, strict=True) if ok)
        nbytes = sum(HEADER_SIZE + pool.meta.nbytes for ok in stored if ok)
        self.stats.record(False, sum(stored), nbytes, time.perf_counter() - started)
        return results

    def _put_pipelined(
        self, pool: PoolBinding, names: list[str], pages: list[Any], replace: bool
    ) -> list[bool]:
        """Encode and put the pages in chunks, each chunk's checksums computed while the one
        before is being written (backends release the GIL while they copy or send), so the
        checksum costs little more than the largest chunk's.

        The pages were just found missing, so they go through ``put_missing`` (one call where
        the backend has a native form: another writer's copy of a page, which is the same
        bytes, is kept); a batch that rewrites a known-bad page needs a real ``put``.
        """
        put = self.backend.put if replace else self.backend.put_missing
        heads = self._headers.slots(len(names))
        per_chunk = max(1, -(-len(names) // self._chunks_for(len(names) * pool.meta.nbytes)))
        in_flight: list[tuple[int, Any]] = []
        for start in range(0, len(names), per_chunk):
            end = min(start + per_chunk, len(names))
            try:
                values = [
                    encode_runs(names[j], pool.runs(pages[j]), pool.meta) for j in range(start, end)
                ]
            except HiCacheError as exc:
                log.warning("hicache: pages not stored: %s", exc)
                break
            for head, value in zip(heads[start:end], values, strict=True):
                head[:] = value[0]  # the header into registered memory, with its page
                value[0] = head
            try:
                in_flight.append((start, self._loop.submit(put(names[start:end], values))))
            except HiCacheError as exc:  # the adapter was closed under this call
                log.warning("hicache: pages not stored: %s", exc)
                break
        stored = [False] * len(names)
        for start, future in in_flight:
            done = self._result(future, "write")
            if done is not None:
                stored[start : start + len(done)] = done
        return stored

    @staticmethod
    def _chunks_for(nbytes: int) -> int:
        # Several chunks only where each stays large: every put is a round trip or more.
        return max(1, min(_MAX_PUT_CHUNKS, nbytes // _MIN_PUT_CHUNK_BYTES))

    async def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix``; how many were there."""
        keys = [info.key async for info in self.backend.scan(prefix)]
        removed = 0
        for start in range(0, len(keys), 512):
            removed += sum(await self.backend.delete(keys[start : start + 512]))
        return removed

    def _call(self, coro: Any, what: str) -> Any:
        """Run one backend call; a storage failure is logged and given back as None."""
        try:
            return self._result(self._loop.submit(coro), what)
        except HiCacheError as exc:  # the loop is closed
            log.warning("hicache: storage %s failed, counted as a miss: %s", what, exc)
        return None

    def _result(self, future: Any, what: str) -> Any:
        """A submitted call's result; a storage failure is logged and given back as None."""
        try:
            return self._loop.wait(future, self._timeout_s)
        except HiCacheError as exc:
            log.warning("hicache: storage %s failed, counted as a miss: %s", what, exc)
        except Exception:
            # SGLang would log it and count a miss too; returning keeps its threads simple.
            log.exception("hicache: storage %s failed unexpectedly, counted as a miss", what)
        return None


def _backend_keys(pool: PoolBinding, keys: Sequence[str]) -> list[str | None]:
    out: list[str | None] = []
    for key in keys:
        try:
            out.append(pool.key(key))
        except InvalidKeyError as exc:
            log.warning("hicache: %s", exc)
            out.append(None)
    return out


def _read_target(pool: PoolBinding, host_index: int) -> _ReadTarget:
    view = pool.page_view(host_index)
    if pool.aliases_pool:
        return _ReadTarget(host_index, pool.runs(view))
    staging = view.new_empty(view.numel())
    return _ReadTarget(host_index, contiguous_runs(staging), staging)
