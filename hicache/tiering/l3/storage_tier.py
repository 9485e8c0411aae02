"""The L3 side of the controller: host pages to a backend and back, on asyncio tasks.

Writes wait in a bounded queue (counted in pages). When a new write does not fit, the least
valuable queued write (fewest hits, then newest) is dropped and counted, so the scheduler that
submits never waits. Worker tasks skip pages L3 already holds (one ``exists`` call), write the
rest in batches, and acknowledge each job once every call has returned.

At most ``concurrency`` prefetches talk to L3 at once, the others wait in the order they started.
A prefetch asks L3 how many leading pages it holds (in growing batches, up to the first page
whose anchor objects are missing), takes host pages for them through a callback
of the tree (which may evict host pages and applies the capacity limit), and reads them in
batches, acknowledging each batch. A stop request ends it between batches. A backend call that
runs past its deadline counts as failed, but its buffers stay reserved until it has returned:
a late read can never land in a host page that was given to someone else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hicache.backends.base import StorageBackend
from hicache.tiering.common.config import PrefetchConfig, StorageConfig
from hicache.tiering.common.metrics import HiCacheMetrics
from hicache.tiering.common.policies import TerminationReason
from hicache.tiering.l3.bundler import BundlePage, PageBundler
from hicache.tiering.l3.failure_log import FailureLog
from hicache.tiering.l3.registration import register_buffers, unregister_buffers
from hicache.tiering.l3.repair import CopyChecker, SuspectKeys
from hicache.tiering.l3.supervisor import TaskSupervisor

__all__ = ["PrefetchOp", "StorageTier", "WriteJob"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Host pages for the first n usable pages, per pool: bundle pages with their host pages set.
HostAllocator = Callable[[int], "list[BundlePage] | None"]
# From which objects L3 holds per candidate page (by pool), how many leading pages to read.
ReadPlanner = Callable[[list[dict[str, bool]]], int]


@dataclass(eq=False, slots=True)
class WriteJob:
    """Host pages of one tree node on their way to L3."""

    pages: list[BundlePage]
    value: float  # higher is worth more; the lowest is dropped first when the queue is full
    owner: Any = None  # what the submitter needs back with the acknowledgement
    ok: list[bool] | None = None  # per page, once acknowledged
    dropped: bool = False


@dataclass(eq=False, slots=True)
class PrefetchOp:
    """One request's L3 prefetch: candidate pages, then the host pages read so far."""

    rid: str
    candidates: list[BundlePage]  # host pages -1: they are taken once L3 answered
    alloc_host: HostAllocator
    start_s: float
    plan: ReadPlanner
    owner: Any = None
    # Pools whose objects every usable page needs (the anchor and its sidecars): L3 is asked
    # no further than the first page missing one of them. Empty: every candidate is asked.
    required: frozenset[str] = frozenset()
    hit_pages: int | None = None  # None until L3 answered how many leading pages it holds
    host_pages: list[BundlePage] = field(default_factory=list)  # granted, per pool
    completed_pages: int = 0  # read and checked, batch by batch
    stop_requested: bool = False
    reads_finished: bool = False  # no read is in flight and none will start
    reason: TerminationReason | None = None
    taken_pages: int | None = None  # pages the tree took when it stopped or finished the op
    task: asyncio.Task[None] | None = None


class StorageTier:
    """Bounded write queue and prefetch reads between host pools and one backend."""

    def __init__(
        self,
        config: StorageConfig,
        prefetch: PrefetchConfig,
        bundler: PageBundler,
        metrics: HiCacheMetrics,
    ) -> None:
        self.config = config
        self.prefetch_config = prefetch
        self.bundler = bundler
        self.metrics = metrics
        self.backend: StorageBackend | None = None
        self._queue: deque[WriteJob] = deque()
        self._queued_pages = 0
        self._writing = 0  # jobs a worker is writing now
        self._wakeup = asyncio.Event()  # a write was queued
        # Set whenever something finishes (a write acknowledged, a prefetch's reads returned):
        # the scheduler and quiesce() wait on it instead of polling.
        self._activity = asyncio.Event()
        self.write_acks: deque[WriteJob] = deque()
        self.finished_prefetches: deque[PrefetchOp] = deque()
        self._supervisor = TaskSupervisor(lambda *_: metrics.add("task_restarts"))
        self._prefetch_tasks: set[asyncio.Task[None]] = set()
        self._prefetch_turns = asyncio.Semaphore(prefetch.concurrency)  # FIFO among waiters
        self.suspects = SuspectKeys()  # keys whose objects failed their checks
        self.copies = CopyChecker(bundler)  # reads present copies of computed pages back
        self._registered: list[Any] = []  # host buffers registered with the backend
        self.read_bytes_per_s: float | None = None  # measured on prefetch reads, smoothed
        self.write_bytes_per_s: float | None = None  # measured on L3 writes, smoothed
        self._failures = FailureLog(logger, "L3 call failed")  # counted in metrics, each one
        metrics.gauge("l3_write_queue_pages", lambda: self._queued_pages)
        metrics.gauge("l3_read_bytes_per_s", lambda: self.read_bytes_per_s or 0.0)
        metrics.gauge("l3_write_bytes_per_s", lambda: self.write_bytes_per_s or 0.0)

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def queued_pages(self) -> int:
        return self._queued_pages

    @property
    def prefetches_running(self) -> int:
        return len(self._prefetch_tasks)

    @property
    def busy(self) -> bool:
        """Writes queued or running, prefetches running, or results not yet applied."""
        return bool(
            self._queue
            or self._writing
            or self._prefetch_tasks
            or self.write_acks
            or self.finished_prefetches
        )

    async def wait_for_activity(self, timeout_s: float) -> None:
        """Return once something finished since the last wait, or after ``timeout_s``."""
        if not self._activity.is_set():
            try:
                await asyncio.wait_for(self._activity.wait(), timeout_s)
            except TimeoutError:
                return
        self._activity.clear()

    def _finished(self) -> None:
        self._activity.set()

    def start(self, backend: StorageBackend) -> None:
        """Write and prefetch through ``backend``; host memory is registered with it when it
        moves data by address, so pages travel without a staging copy."""
        self.backend = backend
        memory = [*self.bundler.registrable_memory(), *self.copies.memory()]
        self._registered = register_buffers(backend, memory)
        for i in range(self.config.workers):
            self._supervisor.start(f"l3-writer-{i}", self._write_worker)

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for queued and running writes to finish; whether they did."""
        deadline = time.monotonic() + timeout_s
        while self._queue or self._writing:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait_for_activity(left)
        return True

    async def stop(self) -> None:
        await self._supervisor.stop()
        for task in list(self._prefetch_tasks):
            task.cancel()
        if self._prefetch_tasks:
            await asyncio.gather(*self._prefetch_tasks, return_exceptions=True)
        if self.backend is not None and not self.backend.closed:
            unregister_buffers(self.backend, self._registered)
        self._registered = []
        self.backend = None
        self._failures.flush()

    # ----- writes ---------------------------------------------------------------------------
    def submit_write(self, job: WriteJob) -> None:
        """Queue ``job``; never waits. A job that cannot fit is acknowledged as dropped."""
        self.metrics.add("pages_submitted_l3", len(job.pages))
        if not job.pages:
            job.ok = []
            self.write_acks.append(job)
            self._finished()
            return
        excess = self._queued_pages + len(job.pages) - self.config.write_queue_pages
        if excess > 0:
            # Only writes worth less than the newcomer make room, cheapest first, and only
            # when together they make enough: otherwise the newcomer is the one dropped.
            # Newest first among equals (sorted() is stable over the reversed queue).
            cheaper = [j for j in reversed(self._queue) if j.value < job.value]
            cheaper.sort(key=lambda j: j.value)
            victims, freed = [], 0
            for victim in cheaper:
                if freed >= excess:
                    break
                victims.append(victim)
                freed += len(victim.pages)
            if freed < excess:
                self._drop(job)
                return
            for victim in victims:
                self._queue.remove(victim)
                self._queued_pages -= len(victim.pages)
                self._drop(victim)
        self._queue.append(job)
        self._queued_pages += len(job.pages)
        self._wakeup.set()

    def _drop(self, job: WriteJob) -> None:
        job.dropped = True
        job.ok = [False] * len(job.pages)
        self.metrics.add("dropped_writes", len(job.pages))
        self.write_acks.append(job)
        self._finished()

    async def _write_worker(self) -> None:
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self._queue.popleft()
            self._queued_pages -= len(job.pages)
            self._writing += 1
            try:
                job.ok = await self._write_job(job)
            finally:
                self._writing -= 1
                if job.ok is None:
                    job.ok = [False] * len(job.pages)
                self.write_acks.append(job)
                self._finished()

    async def _write_job(self, job: WriteJob) -> list[bool]:
        assert self.backend is not None
        backend = self.backend
        keys = [self.bundler.keys(p) for p in job.pages]
        present = await self._bounded(self._present(backend, keys), None)
        ok = list(present) if present is not None else [False] * len(job.pages)
        self.metrics.add("pages_skipped_l3", sum(ok))
        todo = [i for i, done in enumerate(ok) if not done]
        step = self.config.write_batch_pages
        for lo in range(0, len(todo), step):
            batch = todo[lo : lo + step]
            pages = [job.pages[i] for i in batch]
            started = time.perf_counter()
            landed = await self._bounded(
                self.bundler.write(backend, pages, [keys[i] for i in batch]), None
            )
            seconds = time.perf_counter() - started
            for i, good in zip(batch, landed or [False] * len(batch), strict=True):
                ok[i] = good
                if good:  # a landed copy replaces a bad one: counted, and no longer suspect
                    self.metrics.add("l3_repaired_pages", self.suspects.discard(keys[i].values()))
            written = sum(landed or [])
            nbytes = sum(self.bundler.bytes_of(p) for p, good in zip(pages, landed or []) if good)
            self.metrics.add("pages_written_l3", written)
            self.metrics.add("bytes_host_to_l3", nbytes)
            self.write_bytes_per_s = _smoothed(self.write_bytes_per_s, nbytes, seconds)
            self.metrics.add("l3_write_failures", len(batch) - written)
        return ok

    async def _present(
        self, backend: StorageBackend, keys: Sequence[Mapping[str, str]]
    ) -> list[bool]:
        """Per page, whether every object of it is already in L3 and checks out.

        ``exists`` is not enough: the engine computed these pages, so whatever L3 holds of them
        was not read (or not usable), and may be damaged. Present copies are read back and
        checked (``storage.check_present``); a damaged one becomes a suspect and is rewritten.
        """
        flat = [k for ks in keys for k in ks.values()]
        vouched = self.suspects.vouched(flat, await backend.exists(flat))
        found = dict(zip(flat, vouched, strict=True))
        held = [ks for ks in keys if all(found[k] for k in ks.values())]
        if held and self.config.check_present:
            self.metrics.add("pages_checked_l3", len(held))
            damaged, gone = await self.copies.unusable(backend, held)
            # Gone: listed by exists, then not delivered, which is how a store that checks its
            # own records (disk://) reports a damaged one. Either way L3 held a copy it could
            # not give back, and the write that replaces it is a repair.
            self.suspects.add([*damaged, *gone])
            found.update(dict.fromkeys([*damaged, *gone], False))
        return [all(found[k] for k in ks.values()) for ks in keys]

    # ----- prefetch -------------------------------------------------------------------------
    def start_prefetch(self, op: PrefetchOp) -> None:
        task = asyncio.get_running_loop().create_task(self._prefetch(op), name=f"prefetch:{op.rid}")
        op.task = task
        self._prefetch_tasks.add(task)
        task.add_done_callback(self._prefetch_done)
        self.metrics.add("prefetch_started")

    def _prefetch_done(self, task: asyncio.Task[None]) -> None:
        self._prefetch_tasks.discard(task)
        self._finished()

    async def _prefetch(self, op: PrefetchOp) -> None:
        try:
            async with self._prefetch_turns:
                if not op.stop_requested:  # stopped while waiting its turn: nothing to read
                    await self._prefetch_steps(op)
        except Exception:  # a bug, not a backend failure: those are counted where they happen
            logger.exception("prefetch %s failed", op.rid)
            self.metrics.add("errors")
            op.reason = op.reason or TerminationReason.ERROR
        finally:
            op.reads_finished = True
            self.finished_prefetches.append(op)
            self._finished()

    async def _prefetch_steps(self, op: PrefetchOp) -> None:
        assert self.backend is not None
        backend = self.backend
        hits = await self._bounded(self._usable_pages(backend, op), op)
        if hits is None:  # nothing is known of these pages: every one is a failed read
            self.metrics.add("l3_read_failures", len(op.candidates))
        op.hit_pages = hits or 0
        page_size = self.bundler.formats[next(iter(self.bundler.formats))].page_size
        if hits is None or op.stop_requested:
            return
        if op.hit_pages * page_size < self.prefetch_config.threshold_tokens:
            op.reason = op.reason or TerminationReason.BELOW_THRESHOLD
            return
        pages = op.alloc_host(op.hit_pages)
        if not pages or len(pages) * page_size < self.prefetch_config.threshold_tokens:
            op.host_pages = list(pages or [])
            op.reason = op.reason or TerminationReason.NO_HOST_MEMORY
            return
        op.host_pages = list(pages)
        step = self.prefetch_config.batch_pages
        for lo in range(0, len(pages), step):
            if op.stop_requested:
                return
            batch = pages[lo : lo + step]
            started = time.perf_counter()
            corrupt: list[str] = []
            loaded = await self._bounded(self.bundler.read(backend, batch, None, None, corrupt), op)
            if corrupt:
                await self._remove_corrupt(backend, corrupt)
            nbytes = sum(self.bundler.bytes_of(p) for p in batch)
            self._observe_read(nbytes, time.perf_counter() - started)
            if loaded is None:
                self.metrics.add("l3_read_failures", len(pages) - lo)  # this batch and the rest
                return
            if not op.stop_requested:
                op.completed_pages += loaded
                arrived = sum(self.bundler.bytes_of(p) for p in batch[:loaded])
                self.metrics.add("bytes_l3_to_host", arrived)
            if loaded < len(batch):
                return

    async def _remove_corrupt(self, backend: StorageBackend, keys: list[str]) -> None:
        """Delete objects that failed their checks; their keys stay suspects until rewritten."""
        self.suspects.add(keys)
        removed = await self._bounded(backend.delete(keys), None)
        self.metrics.add("corrupt_removed", sum(removed or []))

    def _observe_read(self, nbytes: int, seconds: float) -> None:
        self.read_bytes_per_s = _smoothed(self.read_bytes_per_s, nbytes, seconds)

    async def _usable_pages(self, backend: StorageBackend, op: PrefetchOp) -> int:
        """How many leading pages L3 can serve, by the op's planner (every pool's hit rule).

        Asked in batches that double from ``batch_pages``, until a page lacks one of the op's
        ``required`` objects: no usable prefix reaches past it, so the pages after it are not
        asked about (a burst's requests mostly miss early, and each key asked costs the backend a
        lookup). They count as absent.
        """
        candidates = op.candidates
        found: list[dict[str, bool]] = []
        size = self.prefetch_config.batch_pages
        while len(found) < len(candidates) and not op.stop_requested:
            keys = [self.bundler.keys(p) for p in candidates[len(found) : len(found) + size]]
            present = iter(await backend.exists([k for ks in keys for k in ks.values()]))
            batch = [{name: next(present) for name in ks} for ks in keys]
            found += batch
            if any(not all(page.get(n, False) for n in op.required) for page in batch):
                break
            size *= 2
        self.metrics.add("l3_lookup_candidates", len(candidates))
        self.metrics.add("l3_lookup_pages", len(found))
        return op.plan(found + [{} for _ in range(len(candidates) - len(found))])

    # ----- deadlines ------------------------------------------------------------------------
    async def _bounded(self, call: Awaitable[T], op: PrefetchOp | None) -> T | None:
        """``call``'s result, or None when it raised or ran past the deadline (counted).

        A late call is still awaited: its buffers are in use until it returns.
        """
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.config.op_deadline_s)
            if not done:
                self.metrics.add("timeouts")
                if op is not None:
                    op.reason = op.reason or TerminationReason.ERROR
                await _settled(task)  # its failure, if any, is already counted as a timeout
                return None
            return task.result()
        except asyncio.CancelledError:
            # Our caller is cancelled (asyncio.wait never raises the call's own cancellation).
            # Cancel the call and wait for it to end before going on: left pending, it would
            # be destroyed with the loop ("Task was destroyed but it is pending") and could
            # still be using buffers its caller is about to release.
            task.cancel()
            await _settled(task)
            raise
        except Exception as exc:
            self.metrics.add("errors")
            self._failures.failed(exc)  # the first of each kind, then a summary now and then
            if op is not None:
                op.reason = op.reason or TerminationReason.ERROR
            return None


async def _settled(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` to end and retrieve its outcome, so that nothing is logged for it when
    it is collected. Its own cancellation or error is swallowed; a cancellation of the caller
    while waiting is raised."""
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()


def _smoothed(old: float | None, nbytes: int, seconds: float) -> float | None:
    """A rate of L3 calls, each new call weighing 0.3."""
    if seconds <= 0 or nbytes <= 0:
        return old
    rate = nbytes / seconds
    return rate if old is None else 0.7 * old + 0.3 * rate
