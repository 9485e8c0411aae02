"""L3 prefetch of requests: start, progress by stop policy, and what a stop leaves behind.

``start`` reads the page-aligned part of a request after its device and host hit;
``may_run`` tells the scheduler whether the request may run (the stop policy decides), and
when a prefetch stops, the pages that arrived are handed to the tree at once, while host pages
still being read are freed only once their reads have returned: a late read never lands in a
page given to someone else.

Host pages are granted to a prefetch the moment L3 has said how many leading pages it holds
(:meth:`Prefetcher.grant`, called by the storage tier on the scheduler's event loop), within
``capacity_share`` of the host pool, evicting host-only leaves if needed. How many leading pages
are usable, and which pools each of them needs read, follows every pool's hit rule
(:func:`~hicache.tiering.host.pool.plan_reads`): an SWA pool's window at the end of the hit,
a state pool's snapshot at its last page.

A prefetch started with ``reserve`` keeps what it inserted for its request: the last inserted
node stays anchored (host eviction cannot take it or its host chain) and its pages count
against ``capacity_share`` until :meth:`Prefetcher.release`, called when the request is
admitted or fails. Without it, requests queued behind a burst lose their prefetched pages to the
backups of the requests running before them. A prefetch that got fewer pages than L3 held (no
host room then) leaves a ``shortfall`` that the scheduler may read when the request is about to
run, as an ``urgent`` prefetch (past ``capacity_share``, as a load-back would be).
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.keys import RadixKey
from hicache.radix.node import TreeNode
from hicache.radix.tree import MatchResult
from hicache.tiering.common.config import PrefetchConfig
from hicache.tiering.common.metrics import HiCacheMetrics
from hicache.tiering.common.policies import TerminationReason, can_terminate, prefetch_timeout
from hicache.tiering.host.eviction import HostEvictor
from hicache.tiering.host.pool import plan_reads
from hicache.tiering.l3.bundler import BundlePage, PageHasher
from hicache.tiering.l3.prefetch_insert import PrefetchInserter
from hicache.tiering.l3.storage_tier import PrefetchOp, StorageTier

__all__ = ["Prefetcher"]


class Prefetcher:
    """The running prefetches of one tiered cache, by request id.

    Pages that arrived go into the tree through ``inserter``; host pages come from ``host``
    (which also keeps the host chain a running prefetch hangs from).
    """

    def __init__(
        self,
        inserter: PrefetchInserter,
        host: HostEvictor,
        storage: StorageTier,
        hasher: PageHasher,
        config: PrefetchConfig,
        clock: Callable[[], float],
    ) -> None:
        self._inserter = inserter
        self._pools = host.pools
        self._storage = storage
        self._evictor = host
        self._host = host.host
        self._hasher = hasher
        self.config = config
        self._clock = clock
        self.metrics: HiCacheMetrics = storage.metrics
        self.page_size = hasher.page_size
        self.running: dict[str, PrefetchOp] = {}
        self.anchors = host.anchors  # node id -> prefetches hanging from it (and load-backs)
        self.pages_in_use = 0  # host pages held by prefetches not yet settled
        self.inserted_tokens: dict[str, int] = {}  # rid -> tokens its prefetch inserted
        self._reserving: set[str] = set()  # rids whose prefetches keep what they insert
        self._reserved: dict[str, list[tuple[TreeNode, int]]] = {}  # rid -> (node, pages)
        self._shortfall: dict[str, int] = {}  # rid -> pages L3 held that were not read
        self._yielded: set[str] = set()  # rids whose kept pages went (yield_reserved)

    # ----- starting -------------------------------------------------------------------------
    def start(
        self,
        rid: str,
        key: RadixKey,
        match: MatchResult,
        reserve: bool = False,
        urgent: bool = False,
        whole: bool = False,
    ) -> bool:
        """Read from L3 the page-aligned part of ``key`` after ``match``'s device and host hit.

        Only when L3 is on, at least ``threshold_tokens`` are asked for and the request has no
        prefetch yet; whether one started. ``reserve``: keep what it inserts for ``rid`` until
        :meth:`release`. ``urgent``: for a request about to run, which needs its pages as a
        load-back does: host pages past ``capacity_share`` may be taken. ``whole``: read all
        the pages L3 holds or none (a read ahead of the request's turn, which may read the
        rest then, takes no part of them).
        """
        if not self._storage.enabled or not self.config.enabled or rid in self.running:
            return False
        self._shortfall.pop(rid, None)
        self._yielded.discard(rid)
        start = match.prefix_len + match.host_hit_length
        end = len(key) - len(key) % self.page_size
        if end - start < self.config.threshold_tokens:
            self.metrics.add("prefetch_skipped_small")
            return False
        last: TreeNode = match.last_host_node or match.last_device_node
        candidates = self._hasher.candidates(key, start, end, last)
        reads: list[frozenset[str]] = []

        def plan(found: list[dict[str, bool]]) -> int:
            hit, needed = plan_reads(self._pools.roles, found)
            reads[:] = needed
            return hit

        def grant(n_pages: int) -> list[BundlePage] | None:
            return self.grant(candidates, reads[:n_pages], limited=not urgent, whole=whole)

        anchor_group = frozenset(self._pools.groups[self._pools.roles.anchor])
        op = PrefetchOp(rid, candidates, grant, self._clock(), plan, (last, key, start),
                        anchor_group)  # fmt: skip
        self.anchors[last.id] += 1
        self.running[rid] = op
        if reserve:
            self._reserving.add(rid)
        self._storage.start_prefetch(op)
        return True

    # ----- reservations ---------------------------------------------------------------------
    @property
    def room_pages(self) -> int:
        """Host pages a new prefetch could be granted under ``capacity_share`` now."""
        return int(self.config.capacity_share * self._host.num_pages) - self.pages_in_use

    def shortfall_tokens(self, rid: str) -> int:
        """Tokens L3 held for ``rid``'s last prefetch that it could not read (no host room)."""
        return self._shortfall.get(rid, 0) * self.page_size

    def release(self, rid: str) -> int:
        """``rid`` was admitted or is gone: drop what its prefetches reserved; the tokens they
        inserted (its L3 hit)."""
        self._drop_reserved(rid)
        self._reserving.discard(rid)
        self._shortfall.pop(rid, None)
        self._yielded.discard(rid)
        return self.inserted_tokens.pop(rid, 0)

    def yield_reserved(self) -> int:
        """Let host eviction take what finished prefetches keep for waiting requests, because
        a running request needs the host memory (the pages stay in L3); how many pages they
        kept. Those requests are marked (:meth:`yielded`) until their next prefetch: when their
        turn comes they read again what host eviction took
        (:class:`~hicache.serving.l3_reads.L3Reads`), and reserve again."""
        self._yielded.update(self._reserved)
        return sum(self._drop_reserved(rid) for rid in list(self._reserved))

    def _drop_reserved(self, rid: str) -> int:
        """Let go of what ``rid``'s finished prefetches keep; how many pages that was."""
        pages = 0
        for node, kept in self._reserved.pop(rid, []):
            self.anchors[node.id] -= 1
            if self.anchors[node.id] <= 0:
                del self.anchors[node.id]
            self.pages_in_use -= kept
            pages += kept
        return pages

    def yielded(self, rid: str) -> bool:
        """Whether ``rid``'s kept pages went to :meth:`yield_reserved` since its last prefetch."""
        return rid in self._yielded

    def grant(
        self,
        candidates: list[BundlePage],
        reads: list[frozenset[str]],
        limited: bool = True,
        whole: bool = False,
    ) -> list[BundlePage] | None:
        """Host pages for a prefetch whose first ``len(reads)`` candidate pages L3 can serve:
        as many leading pages as the capacity share (when ``limited``) and the host pools
        allow (all of them or None when ``whole``), each with a host page for every pool it
        reads; or None."""
        n_pages = len(reads)
        room = self.room_pages if limited else n_pages
        if room < n_pages:
            self.metrics.add("prefetch_skipped_capacity")
            n_pages = 0 if whole else max(room, 0)
        if n_pages == 0:
            return None
        pages = self._evictor.alloc(n_pages)
        if pages is None and whole:
            return None
        if pages is None:
            n_pages = min(n_pages, self._host.available_pages)
            pages = self._host.alloc(n_pages) if n_pages else None
        if pages is None:
            return None
        groups = self._pools.groups
        host_pages: list[dict[str, int]] = [
            dict.fromkeys(groups[self._pools.roles.anchor], page) for page in pages.tolist()
        ]
        if not self._grant_extras(host_pages, reads):
            self._pools.free_pages(_pages(candidates, host_pages))
            return None
        self.pages_in_use += len(host_pages)
        return _pages(candidates, host_pages)

    def _grant_extras(self, host_pages: list[dict[str, int]], reads: list[frozenset[str]]) -> bool:
        """Host pages of every extra pool the granted pages read; False if one ran out (what
        was granted stays in ``host_pages``, for the caller to free)."""
        groups = self._pools.groups
        for owner in self._pools.roles.extra:
            at = [i for i in range(len(host_pages)) if owner in reads[i]]
            if not at:
                continue
            got = self._evictor.alloc_pool(owner, len(at))
            if got is None:
                return False
            for i, page in zip(at, got.tolist(), strict=True):
                host_pages[i].update(dict.fromkeys(groups[owner], page))
        return True

    def reading(self, rid: str) -> bool:
        """Whether ``rid`` has a prefetch that has not been stopped or settled yet."""
        op = self.running.get(rid)
        return op is not None and op.taken_pages is None

    # ----- stopping -------------------------------------------------------------------------
    def may_run(self, rid: str) -> bool:
        """Whether request ``rid`` may be scheduled now; stops its prefetch when it may."""
        op = self.running.get(rid)
        if op is None or op.taken_pages is not None:
            return True
        tokens = (op.hit_pages or 0) * self.page_size
        cfg = self.config
        timeout = prefetch_timeout(
            cfg.timeout_base_s, cfg.timeout_per_1k_tokens_s, cfg.timeout_max_s, tokens
        )
        elapsed = self._clock() - op.start_s
        # A failed call (an error, or one past its deadline that is still running) ends the
        # wait: nothing more will arrive, whatever the policy.
        finished = op.reads_finished or op.reason is not None
        reason = can_terminate(cfg.stop_policy, finished, elapsed, timeout)
        if reason is None:
            return False
        self._stop(op, (op.reason or reason) if finished else reason)
        return True

    def terminate(self, rid: str, reason: TerminationReason = TerminationReason.ABORTED) -> None:
        """Stop ``rid``'s prefetch now, keeping what has arrived."""
        op = self.running.get(rid)
        if op is not None and op.taken_pages is None:
            self._stop(op, reason)

    def apply_finished(self) -> None:
        """Settle prefetches whose reads have all returned (once per scheduler step)."""
        finished = self._storage.finished_prefetches
        while finished:
            op = finished.popleft()
            if op.taken_pages is None:
                self._take(op, op.reason or TerminationReason.COMPLETE)
            self._free_tail(op)

    def _stop(self, op: PrefetchOp, reason: TerminationReason) -> None:
        op.stop_requested = True
        self._take(op, reason)
        if op.reads_finished:
            self._free_tail(op)

    def _take(self, op: PrefetchOp, reason: TerminationReason) -> None:
        """Insert the pages that arrived; the rest waits for its reads (``_free_tail``)."""
        taken = op.completed_pages
        op.taken_pages = taken
        op.reason = reason
        last, key, start = op.owner
        self.anchors[last.id] -= 1
        if self.anchors[last.id] <= 0:
            del self.anchors[last.id]
        inserted, node = 0, None
        if taken:
            inserted, node = self._inserter.insert(key, start, op.host_pages[:taken])
        kept = 0
        if node is not None and inserted and op.rid in self._reserving:
            kept = inserted
            self.anchors[node.id] += 1
            self._reserved.setdefault(op.rid, []).append((node, kept))
        self.pages_in_use -= taken - kept
        if op.hit_pages is not None and op.hit_pages > taken:
            self._shortfall[op.rid] = op.hit_pages - taken
        tokens = inserted * self.page_size
        self.metrics.add("l3_hit_tokens", tokens)
        self.inserted_tokens[op.rid] = self.inserted_tokens.get(op.rid, 0) + tokens
        self.metrics.add("l3_miss_tokens", (len(op.candidates) - taken) * self.page_size)
        self.metrics.add(f"prefetch_{reason.value}")

    def _free_tail(self, op: PrefetchOp) -> None:
        if op.taken_pages is None or self.running.get(op.rid) is not op:
            return
        tail = op.host_pages[op.taken_pages :]
        self._pools.free_pages(tail)
        self.pages_in_use -= len(tail)
        del self.running[op.rid]


def _pages(candidates: list[BundlePage], host_pages: list[dict[str, int]]) -> list[BundlePage]:
    """The first ``len(host_pages)`` candidates with their granted host pages."""
    return [
        BundlePage(c.namespace, c.page_hash, pages, c.page_index, c.parent_hash)
        for c, pages in zip(candidates, host_pages, strict=False)
    ]
