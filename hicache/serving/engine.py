"""The serving engine: continuous batching over the tiered cache.

Each step: apply what the cache's background work finished, admit waiting requests in the
scheduler's order (a request whose L3 prefetch the stop policy says to wait for stays queued, and
does not hold up others; so does one whose uncached prefix a request in flight is computing, see
:mod:`hicache.scheduling.prefix_hold`), then run one chunk of every running request: a prefill
chunk of the uncached suffix, or one decode token. A request takes its cached prefix (device hit,
plus host pages loaded back, whose per-layer events the forward pass waits on) and slots for the
rest of its prompt and output, all at admission, so a running request never waits for memory. The
model's extra pools (an SWA window pool, recurrent-state snapshots) have lifecycles of their own
(:mod:`hicache.serving.pool_slots`): admission reserves what a request will hold there at most.
With HiSparse (the dsa and dsv4 presets, :mod:`hicache.serving.hisparse`) a request takes anchor
slots for its prompt only and decodes from a hot buffer row over host memory once its prompt is
computed (dsv4 keeps its SWA and C128 slots on the device).
:meth:`Engine.observe` registers a callback for one kind of event the loop reports (an admission
round, an admitted request, a step, a chunk, a sampled token: :mod:`.engine_events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from hicache.models.types import ChunkInput, ServingModel
from hicache.pools.req_to_token import ReqToTokenPool
from hicache.radix.tree import RadixCache
from hicache.scheduling.scheduler import PrefillDelayer, PrefixScheduler, SchedulerConfig
from hicache.serving.engine_admission import EngineAdmission
from hicache.serving.engine_config import CacheMode, EngineConfig, RequestSource
from hicache.serving.engine_events import ChunkPlanned, EngineObservers, StepStarted, TokenSampled
from hicache.serving.forward_thread import forward_executor
from hicache.serving.l3_reads import L3Reads
from hicache.serving.pool_slots import PoolSlots
from hicache.serving.request import RequestRecord, RequestState, ServeRequest, StepRecord
from hicache.serving.sampling import Draw, sample_token

if TYPE_CHECKING:
    from hicache.serving.hisparse import HiSparseRequests

__all__ = ["CacheMode", "Engine", "EngineConfig", "RequestSource"]  # the config re-exported

E = TypeVar("E")


class Engine(EngineAdmission):
    """One model, its pools and one tree (or none); ``run`` serves a request source."""

    def __init__(
        self,
        model: ServingModel,
        pools: dict[str, Any],
        tree: RadixCache | None,
        config: EngineConfig,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.pools = pools
        self.anchor = next(iter(pools.values()))
        self.tree = tree
        self.config = config
        self._clock = clock
        context = self.anchor.size
        self.req_to_token = ReqToTokenPool(config.max_running, context)
        if tree is not None:
            tree.req_to_token = self.req_to_token
        self.scheduler = PrefixScheduler(
            tree, SchedulerConfig(policy=config.schedule, host_hit_weight=config.host_hit_weight)
        )
        # Holds prefill up to 50 ms while queued requests share prefixes and hits are rare.
        self.delayer = PrefillDelayer(clock=self.now) if config.delay_prefill else None
        self.pool_slots = PoolSlots(model.config, pools, tree, config.chunk_tokens)
        self.records: list[RequestRecord] = []
        self.sparse: HiSparseRequests | None = None  # HiSparse decode (use_hisparse)
        self.observers = EngineObservers()
        self._forward_pool: ThreadPoolExecutor | None = None  # while run() runs
        hiradix = self.hiradix
        self.l3_reads = L3Reads(hiradix, config.skip_slow_prefetch) if hiradix is not None else None
        self._t0 = 0.0
        self._holding = False  # whether a waiting request was held back when last looked at

    def use_hisparse(self, sparse: HiSparseRequests) -> None:
        """Decode DSA requests from ``sparse``'s hot buffer once their prompt is computed."""
        self.sparse = sparse

    def now(self) -> float:
        return self._clock() - self._t0

    def observe(self, callback: Callable[[E], None], kind: type[E]) -> None:
        """Call ``callback(event)`` for every event of ``kind`` the loop reports from now on:
        a class of :mod:`hicache.serving.engine_events`, or
        :class:`~hicache.serving.request.StepRecord` at the end of each step."""
        self.observers.add(callback, kind)

    # ----- the loop ---------------------------------------------------------------------------
    async def run(
        self, source: RequestSource, wake: asyncio.Event | None = None
    ) -> list[RequestRecord]:
        """Serve ``source`` until it has nothing more (``next_arrival`` None) and every request
        is done. ``wake``: set by an online source when a request arrives; with nothing to
        do the loop sleeps until then instead of polling."""
        # One thread runs every forward: torch's intra-op thread team is set up per calling
        # thread, and a new one for each step costs more than a small step.
        with forward_executor() as pool:
            self._forward_pool = pool
            try:
                return await self._run(source, wake)
            finally:
                self._forward_pool = None

    async def _run(self, source: RequestSource, wake: asyncio.Event | None) -> list[RequestRecord]:
        self._t0 = self._clock()
        waiting: list[ServeRequest] = []
        running: list[ServeRequest] = []
        idle_since: float | None = None  # when waiting requests last had nothing running
        while True:
            for request in source.due(self.now()):
                if not self.submit(request, waiting):
                    source.finished(request, self.now())  # failed: its source moves on
            if self.hiradix is not None:
                self.hiradix.check_events()
            self._drop_cancelled(waiting, running, source)
            self._admit(waiting, running)
            if running:
                idle_since = None
                for request in await self._step(running):
                    source.finished(request, self.now())
                continue
            upcoming = source.next_arrival()
            if not waiting and upcoming is None:
                break
            idle_since = idle_since if waiting else None
            if waiting and idle_since is None:
                idle_since = self.now()
            elif idle_since is not None and self.now() - idle_since > self.config.stall_s:
                self._fail_stalled(waiting, source)  # nothing frees memory for them: give up
                idle_since = None
            pause = 0.01 if upcoming is None else max(0.0, min(0.01, upcoming - self.now()))
            if wake is not None and not waiting:  # only an arrival brings work
                await _wait_event(wake, _IDLE_S)
                wake.clear()
            elif self.hiradix is not None:  # a finished prefetch or write wakes it early
                await self.hiradix.wait_for_activity(pause)
            else:
                await asyncio.sleep(pause)
        if self.hiradix is not None:
            self.hiradix.check_events()
        return self.records

    def _fail_stalled(self, waiting: list[ServeRequest], source: RequestSource) -> None:
        tree = self.hiradix
        error = f"no device memory could be had for {self.config.stall_s} s"
        for request in list(waiting):
            if tree is not None and not tree.prefetch_may_run(request.rid):
                continue  # still waiting on its prefetch, which its stop policy allows
            waiting.remove(request)
            self._fail(request, error, source)

    def _drop_cancelled(
        self, waiting: list[ServeRequest], running: list[ServeRequest], source: RequestSource
    ) -> None:
        """Requests whose client went away: a waiting one leaves the queue (its prefetch
        stopped, what it reserved released); a running one ends as if finished, its computed
        pages committed to the tree. Both fail with a "cancelled" error."""
        for request in [r for r in running if r.cancelled]:
            running.remove(request)
            self._finish(request)
            self._fail(request, _CANCELLED, source)
        for request in [r for r in waiting if r.cancelled]:
            waiting.remove(request)
            self._fail(request, _CANCELLED, source)

    def _fail(self, request: ServeRequest, error: str, source: RequestSource) -> None:
        """End a request that left the queue or the batch with ``error``; a prefetch it still
        has is stopped and what that reserved released."""
        if self.hiradix is not None:
            self.hiradix.prefetch_terminate(request.rid)
            self.hiradix.prefetch_release(request.rid)
        request.state = RequestState.FAILED
        request.record.error = error
        source.finished(request, self.now())

    # ----- forward ----------------------------------------------------------------------------
    async def _step(self, running: list[ServeRequest]) -> list[ServeRequest]:
        """One forward over a chunk of every running request; the ones that finished (or
        failed)."""
        self.observers.tell(StepStarted(len(running)))
        done = self._enter_hot(running)
        active = [r for r in running if r.hot is None or r.hot.entered or not self._prefilled(r)]
        if not active:  # all wait for host memory to take their prompt (HiSparse)
            assert self.hiradix is not None
            await self.hiradix.wait_for_activity(0.01)
            return done
        chunks = []
        for request in active:
            chunks.append(self._next_chunk(request))
            self.observers.tell(ChunkPlanned(request, chunks[-1]))
        loads = [load for request in active for load in request.pending_loads]
        began = time.perf_counter()
        hot = self.sparse.buffer if self.sparse is not None else None
        if hot is not None:
            hot.begin_step()
        # In a thread, as a GPU would run it: meanwhile the event loop moves L3 reads and
        # writes on. Nothing else touches the device pools until the forward has returned.
        forward = functools.partial(
            self.model.forward_batch, chunks, self.pools, self._waiter(loads), hot
        )
        logits = await asyncio.get_running_loop().run_in_executor(self._forward_pool, forward)
        prompt_lens = [len(r.prompt) for r in active]
        prefill = sum(len(c.tokens) for c, n in zip(chunks, prompt_lens) if c.start < n)
        if self.l3_reads is not None:
            self.l3_reads.observe_prefill(prefill, time.perf_counter() - began)
        decode = sum(1 for c, n in zip(chunks, prompt_lens) if c.start >= n)
        for request, chunk, out in zip(active, chunks, logits, strict=True):
            request.pending_loads = []
            if self._after_chunk(request, chunk, out):
                running.remove(request)
                self._finish(request)
                done.append(request)
        self.observers.tell(StepRecord(time.perf_counter() - began, prefill, decode))
        return done

    def _enter_hot(self, running: list[ServeRequest]) -> list[ServeRequest]:
        """HiSparse: move requests whose prompt is computed onto the hot buffer; the ones that
        failed to (taken out of ``running``)."""
        if self.sparse is None:
            return []
        ready = [r for r in running if r.hot is not None and not r.hot.entered]
        ready = [r for r in ready if self._prefilled(r)]
        failed = self.sparse.enter_all(
            ready, self.pool_slots.commit, self.now(), self.config.stall_s
        )
        for request in failed:
            running.remove(request)
        return failed

    def _next_chunk(self, request: ServeRequest) -> ChunkInput:
        cached = request.cached
        assert cached is not None
        if request.hot is not None and request.hot.entered:
            assert self.sparse is not None
            return self.sparse.chunk(request)
        start = cached.kv_len
        if start < len(request.prompt):
            tokens = request.prompt[start : start + self.config.chunk_tokens]
        else:
            tokens = [request.generated[-1]]
        row = self.req_to_token.table[cached.req_pool_idx]
        ids = torch.tensor(tokens, dtype=torch.int64)
        chunk = ChunkInput(ids, start, row[: start + len(tokens)])
        self.pool_slots.fill(request.pool_state, chunk)
        return chunk

    def _after_chunk(self, request: ServeRequest, chunk: ChunkInput, logits: torch.Tensor) -> bool:
        """Account for a chunk that ran; whether the request has finished."""
        cached = request.cached
        assert cached is not None
        prompt_len = len(request.prompt)
        cached.kv_len = chunk.start + len(chunk.tokens)
        if chunk.start < prompt_len:
            request.record.computed_tokens += len(chunk.tokens)
        # A chunk ending inside the prompt, or at its end while requests are held back (they
        # may wait for this prompt: they hit all of it while this one decodes; HiSparse commits
        # it as the request enters the hot buffer), or computing a position where the request
        # leaves a window or a snapshot in the tree, commits; before the trim lets go of it.
        keep = self.pool_slots.keep_point_in(request.pool_state, chunk.start, cached.kv_len)
        keep = keep or (self._holding and cached.kv_len == prompt_len and request.hot is None)
        if cached.kv_len < prompt_len or keep:
            self._cache_progress(request)
        self.pool_slots.after_chunk(request.pool_state, cached.kv_len)
        if cached.kv_len < prompt_len:
            return False
        token = self._sample(request, logits)
        self.observers.tell(TokenSampled(request, len(request.generated), logits, token))
        request.generated.append(token)
        if len(request.generated) == 1:
            request.record.first_token_s = self.now()
        if request.on_token is not None:
            request.on_token(token)
        return len(request.generated) >= request.max_new_tokens

    @staticmethod
    def _waiter(loads: list[Any]) -> Callable[[str, int], None] | None:
        if not loads:
            return None

        def wait(pool: str, layer: int) -> None:
            for load in loads:
                load.wait_layer(pool, layer)

        return wait

    def _cache_progress(self, request: ServeRequest) -> None:
        """Commit the pages computed so far so that others can share them meanwhile."""
        if self.tree is not None and request.cached is not None:
            request.cached.token_ids = request.all_tokens
            self.pool_slots.commit(request.cached, request.pool_state)

    def _sample(self, request: ServeRequest, logits: torch.Tensor) -> int:
        cfg, position = self.config, len(request.generated)
        temperature = cfg.temperature if request.temperature is None else request.temperature
        draw = Draw(temperature, request.top_p, request.seed)
        return sample_token(logits, draw, cfg.sample_seed, request.rid, position)

    def _finish(self, request: ServeRequest) -> None:
        cached = request.cached
        assert cached is not None
        cached.token_ids = request.all_tokens
        if request.hot is not None and request.hot.entered:
            self._finished(request)
            return
        if self.tree is None:
            row = self.req_to_token.table[cached.req_pool_idx]
            self.anchor.free(row[: cached.allocated].clone())
            self.req_to_token.free(cached.req_pool_idx)
        self.pool_slots.finish(cached, request.pool_state)
        self._finished(request)

    def _finished(self, request: ServeRequest) -> None:
        if self.sparse is not None:
            self.sparse.release(request)
        request.pool_state = None
        request.state = RequestState.FINISHED
        rec = request.record
        rec.finished_s, rec.output_tokens = self.now(), len(request.generated)


_IDLE_S = 0.5  # an idle online loop still applies finished L3 writes this often
_CANCELLED = "cancelled: the client went away"


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
