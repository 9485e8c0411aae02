"""vLLM 0.33.0 secondary tier backed by a hicache backend.

vLLM calls every tier method from its scheduler thread and wants none of them to block. The
backend (coroutines) runs on a private event loop in one thread that the tier owns
(:class:`~hicache.integrations.sync_loop.SyncLoop`): lookups answer from what the tier already
knows and queue the key for a batched background ``exists`` otherwise (RETRY meanwhile: sent
when vLLM ends the scheduler step), and
jobs only enqueue a coroutine whose :class:`JobResult` lands in a thread-safe queue for
``get_finished_jobs`` (:class:`~hicache.integrations.vllm.jobs.JobBoard`).

Each chunk (one row of the primary view) is one hicache page: the codec's header with a
checksum, then the row's bytes, written straight from and read straight into the primary view.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.registry import open_backend
from hicache.codec import HEADER_SIZE, PageMeta, check_into, encode_page, payload_checked_by
from hicache.dtypes import DType
from hicache.errors import (
    BackendLoadError,
    BackendNotFoundError,
    CodecError,
    HiCacheError,
    InvalidArgumentError,
)
from hicache.integrations.sync_loop import SyncLoop
from hicache.integrations.vllm.jobs import JobBoard
from hicache.integrations.vllm.mapping import populate_writable
from hicache.integrations.vllm.names import StorageNames, format_fields
from hicache.integrations.vllm.verdicts import Verdict, Verdicts
from hicache.urls import redact_url, scrub

__all__ = ["HiCacheTier"]

log = logging.getLogger("hicache.integrations.vllm")
_MISS_TTL_S = 1.0  # how long an absent verdict stands before another writer's chunk is probed
# The lookups of one scheduler step gather into one exists call, sent when vLLM ends the step
# (on_schedule_end), or after this long for a caller that never ends one.
_PROBE_GATHER_S = 0.02
_PROBE_BATCH = 8192  # keys per exists call
# Labels of vLLM's kv_offload_config_info metric (merged with other tiers': hence the prefix).
_INFO_KEYS = ("hicache_scheme", "hicache_n_read_threads", "hicache_n_write_threads")


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


def _event_queue(
    spec: OffloadingSpec, enabled: bool, tier_type: str
) -> collections.deque[OffloadingEvent] | None:
    """Where events go, or None: they need the tier's option and vLLM's KV events both on."""
    if not enabled:
        return None
    if not spec.kv_events_config.enable_kv_cache_events:
        log.warning(
            "hicache vLLM tier %r: enable_kv_events is set but vLLM's KV cache events are off; "
            "the tier emits none",
            tier_type,
        )
        return None
    return collections.deque()


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
        url: str | None = None,
        n_read_threads: int = 8,
        n_write_threads: int = 8,
        io_timeout_s: float = 30.0,
        locality: str | None = None,
        enable_kv_events: bool = False,
        **unknown: object,
    ) -> None:
        if unknown:  # vLLM passes every key of the tier's dict: a typo must not pass unseen
            names = ", ".join(repr(name) for name in sorted(unknown))
            raise ValueError(f"HiCacheTier has no option {names}")
        checked = _check_options(
            url, n_read_threads, n_write_threads, io_timeout_s, locality, enable_kv_events
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = checked
        self._events = _event_queue(offloading_spec, enable_kv_events, tier_type)
        self._io_timeout_s = float(io_timeout_s)
        url = str(url)  # checked: a non-empty str
        self._info = (urlsplit(url).scheme, n_read_threads, n_write_threads)
        chunk = self._block_size_bytes
        self._bytes = primary_kv_view.cast("B")  # chunk c = bytes [c*chunk, (c+1)*chunk)
        populate_writable(self._bytes)  # loads write here: no page faults on a request's path
        self._num_chunks = self._bytes.nbytes // chunk if chunk else 0
        device = str(current_platform.device_type)
        self._names = StorageNames(format_fields(offloading_spec.config, chunk, device))
        self._meta = PageMeta("vllm", DType.UINT8, (chunk,))
        self._verdicts = Verdicts(_MISS_TTL_S)
        self._board: JobBoard[JobResult] = JobBoard()
        # Throttles: each job (and each probe batch) holds one slot for its whole batch.
        self._reads = asyncio.Semaphore(n_read_threads)
        self._writes = asyncio.Semaphore(n_write_threads)
        self._loop = SyncLoop(f"hicache-vllm-{tier_type}")
        self._backend = self._open(url)

    def _open(self, url: str) -> StorageBackend:
        try:
            backend = self._loop.run(open_backend(url), self._io_timeout_s)
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
        self._loop.on_close(backend.close)
        return backend

    # --- lookups ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS from what is known; else queue the key for a batched background
        ``exists`` and say RETRY (vLLM asks again next step)."""
        verdict, first = self._verdicts.check(key)
        if verdict is Verdict.STORED:
            return LookupResult.HIT
        if verdict is Verdict.ABSENT or self._loop.closed:
            return LookupResult.MISS
        if first:  # the first key of a batch: one flush for all that follow
            try:
                self._loop.submit(self._probe_queued(_PROBE_GATHER_S))
            except HiCacheError:  # closed meanwhile: nothing to find any more
                queued = self._verdicts.take_queued()
                self._verdicts.end_probes(queued, [False] * len(queued))
                return LookupResult.MISS
        return LookupResult.RETRY

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Keep the keys' verdicts fresh (a store's own recency follows its reads)."""
        for key in keys:
            self._verdicts.get(key)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The step's lookups are all in: probe the keys they queued now."""
        if self._verdicts.queued():
            with contextlib.suppress(HiCacheError):  # closed: lookup answers MISS from now on
                self._loop.submit(self._probe_queued(0.0))

    async def _probe_queued(self, delay_s: float) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)  # let the rest of this step's lookups queue up
        keys = self._verdicts.take_queued()
        for start in range(0, len(keys), _PROBE_BATCH):
            await self._probe(keys[start : start + _PROBE_BATCH])

    async def _probe(self, keys: list[bytes]) -> None:
        found = [False] * len(keys)
        try:
            async with self._reads:
                names = [self._names.name(k) for k in keys]
                found = await asyncio.wait_for(self._backend.exists(names), self._io_timeout_s)
        except Exception as exc:  # a failed probe is a miss, as vLLM's fs tier counts it
            log.warning("hicache vLLM tier: exists failed: %s", exc)
        finally:
            self._verdicts.end_probes(keys, found)

    # --- jobs ------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Enqueue a store of the job's chunks; its result comes from get_finished_jobs."""
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Enqueue a load into the job's chunks; its result comes from get_finished_jobs."""
        self._submit(job_metadata, self._load)

    def _submit(
        self, job: TransferJob, work: Callable[[TransferJob], Awaitable[JobResult]]
    ) -> None:
        self._board.begin()
        try:
            self._loop.submit(self._run(job, work))
        except HiCacheError as exc:  # closed: the job fails, vLLM goes on
            log.warning("hicache vLLM tier: job %d refused: %s", job.job_id, exc)
            self._board.finish(JobResult(job_id=job.job_id, success=False))

    async def _run(
        self, job: TransferJob, work: Callable[[TransferJob], Awaitable[JobResult]]
    ) -> None:
        """Run one job; every job reports exactly one result, whatever happens.

        ``io_timeout_s`` bounds a job's wait for a free slot, and a store's transfer. A load
        that has started is never cut short: vLLM frees the slots of a failed load for reuse,
        and a read still running in a backend's thread would write into them. (A store cut
        short may still be reading its slot; what it writes late is refused by the page's
        checksum, never served.)
        """
        start = time.monotonic()
        result = JobResult(job_id=job.job_id, success=False)
        slots = self._reads if job.is_promotion else self._writes
        kind = "load" if job.is_promotion else "store"
        try:
            await asyncio.wait_for(slots.acquire(), self._io_timeout_s)
            try:
                if job.is_promotion:
                    result = await work(job)
                else:
                    result = await asyncio.wait_for(work(job), self._io_timeout_s)
            finally:
                slots.release()
        except Exception as exc:
            log.warning("hicache vLLM tier: %s job %d failed: %r", kind, job.job_id, exc)
        finally:
            result.transfer_time = time.monotonic() - start
            self._board.finish(result)

    def _chunk(self, chunk_id: Any) -> memoryview:
        c = int(chunk_id)
        if not 0 <= c < self._num_chunks:
            raise InvalidArgumentError(f"chunk id {c} outside the primary's {self._num_chunks}")
        size = self._block_size_bytes
        return self._bytes[c * size : (c + 1) * size]

    async def _store(self, job: TransferJob) -> JobResult:
        todo: dict[bytes, Any] = {}  # key -> chunk id; a key twice in a job is stored once
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            if key not in todo and self._verdicts.get(key) is not Verdict.STORED:
                todo[key] = chunk_id
        names = [self._names.name(k) for k in todo]
        pages = [encode_page(n, self._chunk(c), self._meta) for n, c in zip(names, todo.values())]
        stored = await self._backend.put_missing(names, pages) if names else []
        landed = [k for k, ok in zip(todo, stored) if ok]
        self._verdicts.mark(landed, True)
        self._announce(landed, removed=False)
        nbytes = len(landed) * self._block_size_bytes
        return JobResult(job_id=job.job_id, success=all(stored), transfer_bytes=nbytes)

    async def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        names = [self._names.name(k) for k in keys]
        dests = [self._chunk(c) for c in job.chunk_ids]
        if len(dests) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(dests)} chunk ids")
        headers = [bytearray(HEADER_SIZE) for _ in keys]
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
            checked = payload_checked_by(self._backend.capabilities.checks_pages_over, size)
            check_into(name, header, dest, size, self._meta, checked)
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
        self._announce(bad, removed=True)  # vLLM had them as hits here
        self._verdicts.mark([k for k, ok in zip(keys, good) if ok], True)
        corrupt = [n for n, ok, s in zip(names, good, sizes) if not ok and s != MISS]
        if corrupt:
            try:
                await self._backend.delete(corrupt)
            except Exception as exc:  # the load's result stands; a later store replaces it
                log.warning(
                    "hicache vLLM tier: deleting %d bad pages failed: %s", len(corrupt), exc
                )

    def _announce(self, keys: list[bytes], removed: bool) -> None:
        if self._events is not None and keys:
            self._events.append(
                OffloadingEvent(
                    keys=[OffloadKey(k) for k in keys],
                    medium=self.medium,
                    removed=removed,
                    locality=self.locality,
                )
            )

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Chunks stored here, and chunks found gone or damaged, since the last call."""
        events: list[OffloadingEvent] = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The results of the jobs that ended since the last call."""
        return self._board.take()

    def has_pending_work(self) -> bool:
        return self._board.pending()

    def drain_jobs(self) -> None:
        """Block until every submitted job has ended: its result is queued and no I/O of it
        touches the primary any more (a queued job waits at most io_timeout_s for a slot)."""
        self._board.wait_idle()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        return dict(zip(_INFO_KEYS, self._info, strict=True))

    def shutdown(self) -> None:
        """Let running jobs end within io_timeout_s; jobs still running then are cancelled and
        reported failed, as are probes not sent yet; then close the backend and the loop."""
        if self._loop.closed:
            return
        if not self._board.wait_idle(self._io_timeout_s):
            late = self._board.in_flight
            log.warning("hicache vLLM tier: %d jobs still running at shutdown: cancelled", late)
        with contextlib.suppress(HiCacheError):
            self._loop.run(_cancel_others(), self._io_timeout_s)
        self._loop.close(self._io_timeout_s)
        # vLLM unmaps the primary only when no buffer export of it is left.
        with contextlib.suppress(BufferError):
            self._bytes.release()


async def _cancel_others() -> None:
    """Cancel every task of the running loop but this one, and wait until each has ended (a
    job reports its failure, a probe marks its keys absent)."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
