"""vLLM 0.33.0 secondary tier backed by a hicache backend.

vLLM calls every tier method from its scheduler thread and wants none of them to block. The
backend (coroutines) runs on a private event loop in one thread that the tier owns
(:class:`~hicache.integrations.sync_loop.SyncLoop`): lookups answer from what the tier already
knows and start a background ``exists`` otherwise (RETRY meanwhile), and jobs only enqueue a
coroutine whose :class:`JobResult` lands in a thread-safe queue for ``get_finished_jobs``.

Each chunk (one row of the primary view) is one hicache page: the codec's header with a
checksum, then the row's bytes, written straight from and read straight into the primary view.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache.backends.base import MISS
from hicache.backends.registry import open_backend
from hicache.codec import HEADER_SIZE, PageMeta, check_into, encode_page
from hicache.dtypes import DType
from hicache.errors import (
    BackendLoadError,
    BackendNotFoundError,
    CodecError,
    HiCacheError,
    InvalidArgumentError,
)
from hicache.integrations.sync_loop import SyncLoop
from hicache.integrations.vllm.names import StorageNames, format_fields
from hicache.integrations.vllm.verdicts import Verdict, Verdicts
from hicache.urls import redact_url, scrub

__all__ = ["HiCacheTier"]

log = logging.getLogger("hicache.integrations.vllm")
_MISS_TTL_S = 1.0  # how long an absent verdict stands before another writer's chunk is probed


def _check_options(
    url: object, n_read: object, n_write: object, timeout: object, locality: object, events: object
) -> Locality | None:
    """The tier's locality; ValueError naming the first bad option."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"HiCacheTier option 'url' must be a non-empty string, got {url!r}")
    for option, value in (("n_read_threads", n_read), ("n_write_threads", n_write)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"HiCacheTier option {option!r} must be an int >= 1, got {value!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(f"HiCacheTier option 'io_timeout_s' must be > 0, got {timeout!r}")
    if not isinstance(events, bool):
        raise ValueError(f"HiCacheTier option 'enable_kv_events' must be a bool, got {events!r}")
    if locality is None:
        return None
    try:
        return Locality(locality)
    except ValueError:
        names = [m.value for m in Locality]
        raise ValueError(
            f"HiCacheTier option 'locality' must be one of {names}, got {locality!r}"
        ) from None


class HiCacheTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM is untyped here
    """A vLLM secondary tier storing chunks as hicache pages in the backend at ``url``."""

    medium = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        url: str,
        n_read_threads: int = 8,
        n_write_threads: int = 8,
        io_timeout_s: float = 30.0,
        locality: str | None = None,
        enable_kv_events: bool = False,
    ) -> None:
        checked = _check_options(
            url, n_read_threads, n_write_threads, io_timeout_s, locality, enable_kv_events
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = checked
        self._enable_kv_events = enable_kv_events  # part 1 emits no events
        self._io_timeout_s = float(io_timeout_s)
        chunk = self._block_size_bytes
        self._bytes = primary_kv_view.cast("B")  # chunk c = bytes [c*chunk, (c+1)*chunk)
        self._num_chunks = self._bytes.nbytes // chunk if chunk else 0
        self._names = StorageNames(format_fields(offloading_spec.config, chunk))
        self._meta = PageMeta("vllm", DType.UINT8, (chunk,))
        self._verdicts = Verdicts(_MISS_TTL_S)
        self._finished: collections.deque[JobResult] = collections.deque()
        self._idle = threading.Condition()
        self._in_flight = 0
        # Throttles: each job holds one slot for its whole batch.
        self._reads = asyncio.Semaphore(n_read_threads)
        self._writes = asyncio.Semaphore(n_write_threads)
        self._loop = SyncLoop(f"hicache-vllm-{tier_type}")
        try:
            self._backend = self._loop.run(open_backend(url), self._io_timeout_s)
        except (ValueError, BackendNotFoundError, BackendLoadError) as exc:
            self._loop.close(self._io_timeout_s)
            self._bytes.release()
            shown = redact_url(url)  # credentials in the URL are never echoed
            raise ValueError(
                f"HiCacheTier option 'url' {shown!r}: {scrub(str(exc), url)}"
            ) from None
        except BaseException:
            self._loop.close(self._io_timeout_s)
            self._bytes.release()
            raise
        self._loop.on_close(self._backend.close)

    # --- lookups ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS from what is known; else start a background ``exists`` and say RETRY."""
        verdict = self._verdicts.get(key)
        if verdict is Verdict.STORED:
            return LookupResult.HIT
        if verdict is Verdict.ABSENT:
            return LookupResult.MISS
        if verdict is Verdict.UNKNOWN and self._verdicts.start_probe(key):
            try:
                self._loop.submit(self._probe(key))
            except HiCacheError:
                self._verdicts.end_probe(key, False)  # closed: nothing to find any more
                return LookupResult.MISS
        return LookupResult.RETRY

    async def _probe(self, key: bytes) -> None:
        found = False
        try:
            async with self._reads:
                found = (
                    await asyncio.wait_for(
                        self._backend.exists([self._names.name(key)]), self._io_timeout_s
                    )
                )[0]
        except Exception as exc:  # a failed probe is a miss, as vLLM's fs tier counts it
            log.warning("hicache vLLM tier: exists failed: %s", exc)
        finally:
            self._verdicts.end_probe(key, found)

    # --- jobs ------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Enqueue a store of the job's chunks; its result comes from get_finished_jobs."""
        self._submit(job_metadata, self._store(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Enqueue a load into the job's chunks; its result comes from get_finished_jobs."""
        self._submit(job_metadata, self._load(job_metadata))

    def _submit(self, job: TransferJob, work: Awaitable[JobResult]) -> None:
        with self._idle:
            self._in_flight += 1
        try:
            self._loop.submit(self._run(job, work))
        except BaseException:
            self._finish(JobResult(job_id=job.job_id, success=False))
            raise

    async def _run(self, job: TransferJob, work: Awaitable[JobResult]) -> None:
        """Run one job; every job reports exactly one result, whatever happens."""
        start = time.monotonic()
        result = JobResult(job_id=job.job_id, success=False)
        try:
            result = await asyncio.wait_for(work, self._io_timeout_s)
        except Exception as exc:
            kind = "load" if job.is_promotion else "store"
            log.warning("hicache vLLM tier: %s job %d failed: %r", kind, job.job_id, exc)
        finally:
            result.transfer_time = time.monotonic() - start
            self._finish(result)

    def _finish(self, result: JobResult) -> None:
        self._finished.append(result)  # deque append/popleft are thread-safe
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def _chunk(self, chunk_id: Any) -> memoryview:
        c = int(chunk_id)
        if not 0 <= c < self._num_chunks:
            raise InvalidArgumentError(f"chunk id {c} outside the primary's {self._num_chunks}")
        size = self._block_size_bytes
        return self._bytes[c * size : (c + 1) * size]

    async def _store(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        todo = [
            (k, c)
            for k, c in zip(keys, job.chunk_ids, strict=True)
            if self._verdicts.get(k) is not Verdict.STORED
        ]
        names = [self._names.name(k) for k, _ in todo]
        pages = [encode_page(n, self._chunk(c), self._meta) for n, (_, c) in zip(names, todo)]
        async with self._writes:
            stored = await self._backend.put_missing(names, pages) if names else []
        self._verdicts.mark([k for (k, _), ok in zip(todo, stored) if ok], True)
        ok = all(stored)
        nbytes = sum(stored) * self._block_size_bytes
        return JobResult(job_id=job.job_id, success=ok, transfer_bytes=nbytes)

    async def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        names = [self._names.name(k) for k in keys]
        dests = [self._chunk(c) for c in job.chunk_ids]
        if len(dests) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(dests)} chunk ids")
        headers = [bytearray(HEADER_SIZE) for _ in keys]
        async with self._reads:
            sizes = await self._backend.get_into(names, [[h, d] for h, d in zip(headers, dests)])
        good = [
            self._accept(name, header, dest, size)
            for name, header, dest, size in zip(names, headers, dests, sizes)
        ]
        await self._forget(keys, names, good, sizes)
        loaded = [k for k, ok in zip(keys, good) if ok]
        nbytes = len(loaded) * self._block_size_bytes
        if len(loaded) == len(keys):
            return JobResult(job_id=job.job_id, success=True, transfer_bytes=nbytes)
        return JobResult(
            job_id=job.job_id, success=False, successful_keys=loaded, transfer_bytes=nbytes
        )

    def _accept(self, name: str, header: bytearray, dest: memoryview, size: int) -> bool:
        """Whether the page read for ``name`` is whole and checks out."""
        if size == MISS:
            return False
        try:
            check_into(name, header, dest, size, self._meta)
        except (CodecError, InvalidArgumentError) as exc:
            log.warning("hicache vLLM tier: page refused: %s: %s", type(exc).__name__, exc)
            return False
        return True

    async def _forget(
        self, keys: list[bytes], names: Sequence[str], good: list[bool], sizes: list[int]
    ) -> None:
        """Mark failed keys absent (so vLLM stops promoting them) and delete bad pages."""
        bad = [k for k, ok in zip(keys, good) if not ok]
        self._verdicts.mark(bad, False)
        self._verdicts.mark([k for k, ok in zip(keys, good) if ok], True)
        corrupt = [n for n, ok, s in zip(names, good, sizes) if not ok and s != MISS]
        if corrupt:
            try:
                await self._backend.delete(corrupt)
            except Exception as exc:  # the load's result stands; a later store replaces it
                log.warning(
                    "hicache vLLM tier: deleting %d bad pages failed: %s", len(corrupt), exc
                )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The results of the jobs that ended since the last call."""
        done: list[JobResult] = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    def has_pending_work(self) -> bool:
        return self._in_flight > 0 or bool(self._finished)

    def drain_jobs(self) -> None:
        """Block until every submitted job has ended (each is bounded by io_timeout_s)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        """Wait up to io_timeout_s for running jobs, then close the backend and the loop."""
        if self._loop.closed:
            return
        with self._idle:
            if not self._idle.wait_for(lambda: self._in_flight == 0, self._io_timeout_s):
                log.warning("hicache vLLM tier: closing with %d jobs running", self._in_flight)
        self._loop.close(self._io_timeout_s)
        # vLLM unmaps the primary only when no buffer export of it is left.
        with contextlib.suppress(BufferError):
            self._bytes.release()
