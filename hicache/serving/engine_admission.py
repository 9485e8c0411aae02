"""Admission, the engine's half that places requests: whether one can ever be served, the
queue's order each round (prefetch waits, prefix holds, the prefill delayer, priorities, L3
read-backs) and taking a request's cached prefix and slots (see :mod:`hicache.serving.engine`).

One look at the tree per waiting request per round orders the queue: the plan's peek (device and
host tokens, touching nothing), kept on the request (``ServeRequest.prefix_match``) for the
round, where the prefix hold reads it. A request admitted then takes its prefix with the round's
one ``match_prefix`` of it: that match splits nodes, counts hits and is what its lock and load-back
act on, so it must see the tree as it is at that moment, after the admissions before it in the
round may have evicted (or loaded back) pages the peek saw. The plan never matches. With L3 on,
whether a request reads its prefix back first is decided from the same peek; a request whose
read starts is matched for it instead of being admitted that round.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hicache.models.types import ServingModel
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.pool_lifecycle import path_anchor
from hicache.radix.tree import RadixCache
from hicache.scheduling.scheduler import PrefillDelayer, PrefixScheduler
from hicache.serving.engine_config import EngineConfig
from hicache.serving.engine_events import AdmissionRound, EngineObservers, RequestAdmitted
from hicache.serving.l3_reads import L3Reads
from hicache.serving.pool_slots import PoolSlots
from hicache.serving.request import RequestRecord, RequestState, ServeRequest
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.contract import TieredCache

if TYPE_CHECKING:
    from hicache.pools.req_to_token import ReqToTokenPool
    from hicache.serving.hisparse import HiSparseRequests

__all__ = ["EngineAdmission"]


class EngineAdmission:
    """The admission methods of :class:`~hicache.serving.engine.Engine`, which sets these."""

    model: ServingModel
    tree: RadixCache | None
    config: EngineConfig
    anchor: Any  # the anchor pool's DevicePool
    req_to_token: ReqToTokenPool
    scheduler: PrefixScheduler
    pool_slots: PoolSlots
    records: list[RequestRecord]
    sparse: HiSparseRequests | None
    delayer: PrefillDelayer | None
    l3_reads: L3Reads | None
    observers: EngineObservers
    _holding: bool

    def now(self) -> float:
        raise NotImplementedError  # the engine's clock

    @property
    def hiradix(self) -> TieredCache | None:
        """The tree when tiered, seen through its contract (:mod:`hicache.tiering.contract`)."""
        return self.tree if isinstance(self.tree, HiRadixCache) else None

    @staticmethod
    def _prefilled(request: ServeRequest) -> bool:
        cached = request.cached
        return cached is not None and cached.kv_len >= len(request.prompt)

    def submit(self, request: ServeRequest, waiting: list[ServeRequest]) -> bool:
        """Queue a request, or fail it (recorded, the run goes on) when it cannot be served."""
        self.records.append(request.record)
        error = self.refusal(request)
        if error is not None:
            request.state, request.record.error = RequestState.FAILED, error
            return False
        waiting.append(request)
        if self.l3_reads is not None:
            self.l3_reads.maybe_prefetch(request)
        return True

    def refusal(self, request: ServeRequest) -> str | None:
        """Why ``request`` can never be served here (prompt or output past the device pool,
        token ids outside the vocabulary, ...); None if it can."""
        vocab = self.model.config.vocab_size
        if request.refusal is not None:
            return request.refusal
        if not request.prompt:
            return "empty prompt"
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in request.prompt):
            return f"token ids must be integers in [0, {vocab})"
        if request.max_new_tokens < 1:
            return "max_new_tokens must be at least 1"
        if self.sparse is not None:
            return self.sparse.refusal(request, self.anchor.size)
        if len(request.prompt) + request.max_new_tokens > self.anchor.size:
            return (
                f"prompt of {len(request.prompt)} tokens plus {request.max_new_tokens} to "
                f"generate do not fit the device pool ({self.anchor.size} tokens)"
            )
        return self.pool_slots.refusal(request)

    def _admit(self, waiting: list[ServeRequest], running: list[ServeRequest]) -> None:
        self.observers.tell(AdmissionRound(len(waiting), len(running)))
        self._holding = self._holding and bool(waiting)
        if not waiting or len(running) >= self.config.max_running:
            return
        plan = self.scheduler.plan(waiting)
        for request in waiting:  # None under a cache-agnostic policy (nothing was peeked)
            request.prefix_match = plan.matches.get(request.rid)
        if self.delayer is not None and self.delayer.should_delay(plan.stats):
            return  # more of the queue may share what the next prefill computes
        hold = self.scheduler.hold(r.key for r in running if not self._prefilled(r))
        admitted: list[ServeRequest] = []
        slots = self.config.max_running - len(running)
        # Slots taken this round; a request reading its prefix back before it starts takes one,
        # so one round does not send every waiting request to L3 at once.
        taken = 0
        in_line = 0  # requests before this one that run first: started, or reading from L3
        ahead = 0  # requests past this round's slots whose L3 read-back starts now
        # Whether a request before in line is still reading: it gets its host pages first.
        reading = False
        for request in _fair_order(plan.requests, running):
            if taken >= slots:
                if ahead >= slots or reading:
                    break
                ahead += self._read_ahead(request)
                continue
            tree = self.hiradix
            if tree is not None and not tree.prefetch_may_run(request.rid):
                taken += request.had_turn  # reading back what it lacks, next to run
                in_line += 1
                reading = True
                continue  # its prefetch is still worth waiting for; others may go first
            peeked = request.prefix_match
            cached = None if peeked is None else peeked.total
            if hold is not None and hold.holds(request, cached):
                request.record.held_rounds += 1  # one in flight computes its prefix: hit it later
                continue
            next_up = in_line < slots
            reads = self.l3_reads
            read_back = reads is not None and reads.maybe_prefetch(request, admitting=next_up)
            request.had_turn = request.had_turn or next_up
            if read_back:  # its cached prefix was evicted meanwhile, or it found no host room
                taken += 1  # at first: it reads that back, then starts
                in_line += 1
                reading = True
                continue
            if reads is not None and reads.short_of_l3(request):
                continue  # L3 holds more of its prefix: it reads that when its turn comes
            if self._start(request):
                self.observers.tell(RequestAdmitted(request))
                admitted.append(request)
                taken += 1
                in_line += 1
                waiting.remove(request)
                running.append(request)
                if hold is not None:
                    hold.claim(request.key)
        self._holding = hold is not None and bool(hold.held)
        self._observe_admitted(admitted)

    def _observe_admitted(self, admitted: list[ServeRequest]) -> None:
        """Tell the prefill delayer how much of what a round admitted was cached."""
        if self.delayer is not None and admitted:
            records = [r.record for r in admitted]
            hits = sum(r.hit_device + r.hit_host + r.hit_l3 for r in records)
            self.delayer.observe(hits, sum(r.prompt_tokens for r in records))

    def _read_ahead(self, request: ServeRequest) -> int:
        """Start the read-back a request would start when next to run (see
        :mod:`~hicache.serving.l3_reads`) while the step before its turn computes, so that its
        pages are on the host when the turn comes instead of a step later. 1 when it counts
        toward the requests read ahead (it has not been next to run yet), else 0."""
        reads, tree = self.l3_reads, self.hiradix
        if reads is None or tree is None or request.had_turn:
            return 0
        if tree.prefetch_reading(request.rid) or request.read_ahead:
            return 1  # reading already, or read ahead once (its turn may still read the rest)
        request.read_ahead = reads.maybe_prefetch(request, ahead=True)
        return 1

    def _start(self, request: ServeRequest) -> bool:
        prefix, last, hits = self._cached_prefix(request)
        tree = self.tree
        # HiSparse: the output never takes anchor slots (it decodes from the hot buffer).
        total = len(request.prompt) + (0 if self.sparse else request.max_new_tokens)
        if self.sparse is not None and not self.sparse.admit(request):
            return False
        page = self.anchor.page_size
        need = -(-(total - len(prefix)) // page) * page
        shared = self.pool_slots.shared_end(request)  # before evicting for the request
        if tree is not None and last is not None:
            tree.inc_lock_ref(last)
        slots = self._alloc(need)
        extra = None
        if slots is not None:
            extra = self.pool_slots.admit(request, len(prefix), last, shared)
        if slots is None or extra is None:
            if slots is not None:
                self.anchor.free(slots)
            if tree is not None and last is not None:
                tree.dec_lock_ref(last)
            if self.sparse is not None:
                self.sparse.release(request)
            return False
        request.pool_state = extra
        row = self.req_to_token.alloc()
        assert row is not None  # max_running rows, and running is below max_running
        self.req_to_token.table[row, : len(prefix)] = prefix
        self.req_to_token.table[row, len(prefix) : len(prefix) + need] = slots
        request.cached = CachedRequest(
            request.rid, request.prompt, row, len(prefix), len(prefix) + need,
            request.namespace, prefix_indices=prefix, last_node=last, priority=request.priority,
        )  # fmt: skip
        request.state = RequestState.RUNNING
        rec = request.record
        rec.admitted_s = self.now()
        rec.hit_device, rec.hit_host, rec.hit_l3 = hits
        if self.hiradix is not None:  # its prefetched pages are its own now (locked)
            self.hiradix.prefetch_release(request.rid)
        return True

    def _cached_prefix(
        self, request: ServeRequest
    ) -> tuple[torch.Tensor, Any, tuple[int, int, int]]:
        empty = torch.empty(0, dtype=torch.int64)
        if self.tree is None or not len(request.key):
            return empty, None, (0, 0, 0)
        match = self.tree.match_prefix(request.key)
        prefix, last = match.device_indices, match.last_device_node
        tree = self.hiradix
        # Read, not taken: the credit is dropped only once the request is admitted (_start).
        from_l3 = tree.prefetch_inserted_tokens(request.rid) if tree is not None else 0
        if tree is None or not match.host_hit_length or match.last_host_node is None:
            return prefix, last, (match.prefix_len, 0, 0)
        anchor_loaded, node = tree.init_load_back(match.last_host_node)
        if node is not match.last_host_node:  # not loaded (or not all): the device hit only
            return prefix, last, (match.prefix_len, 0, 0)
        request.pending_loads = tree.ready_to_load_host_cache()
        # The prefix's anchor slots from its nodes: a load may have brought only some of them
        # (or only another pool's window or snapshot) to the device. Tokens whose anchor was on
        # the device count as device hits, those it loaded as host (or L3) hits.
        full = path_anchor(node)
        loaded = len(anchor_loaded)
        l3 = min(from_l3, loaded)
        return full, node, (len(full) - loaded, loaded - l3, l3)

    def _alloc(self, n: int) -> torch.Tensor | None:
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        slots: torch.Tensor | None = self.anchor.alloc(n)
        if slots is None and self.tree is not None:
            self.tree.evict(n - self.anchor.available_size)
            slots = self.anchor.alloc(n)
        return slots


def _fair_order(
    waiting: Sequence[ServeRequest], running: Sequence[ServeRequest]
) -> list[ServeRequest]:
    """``waiting`` in the order to admit: higher priority first; within a priority, tenants
    take turns, the one with the fewest requests running (plus those of its own ahead in line)
    first, so one tenant's queue does not take every slot that frees. Requests of one tenant
    (every request of an offline run) keep the plan's order."""
    share = Counter(r.tenant for r in running)
    turn: list[tuple[int, int, int, ServeRequest]] = []
    for position, request in enumerate(waiting):
        turn.append((-request.priority, share[request.tenant], position, request))
        share[request.tenant] += 1
    return [request for *_, request in sorted(turn, key=lambda t: t[:3])]
