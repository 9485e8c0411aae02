"""When a waiting request reads its prefix back from L3: at arrival, and when it is next to run.

A request prefetches what device and host lack when it is queued. When it is about to be
scheduled it prefetches again if what was cached then has been evicted meanwhile, or, once, if
its last prefetch left pages in L3 for lack of host room (then as an ``urgent`` prefetch, which
may go past the prefetch share of host memory as a load-back would), or if what its prefetch
kept for it was given up to a running request
(:meth:`~hicache.tiering.contract.TieredCache.prefetch_yield_reserved`). The requests next in line
after those of an admission round start that read then ("ahead": while the step before their
turn computes, and only where the prefetch share of host memory has room for all of it), so
that their pages are on the host when their turn comes rather than a step later. What a
prefetch inserts stays reserved for the request until it is admitted
(:meth:`~hicache.tiering.contract.TieredCache.prefetch_release`). A read expected to be slower than
computing the same tokens (measured rates) is skipped when ``skip_slow`` is on.
"""

from __future__ import annotations

from hicache.serving.request import ServeRequest
from hicache.tiering.contract import PrefetchMode, TieredCache

__all__ = ["L3Reads"]


class L3Reads:
    """The L3 read-back decisions of one engine over its tiered cache."""

    def __init__(self, tree: TieredCache, skip_slow: bool) -> None:
        self.tree = tree
        self.skip_slow = skip_slow
        self.prefill_tokens_per_s: float | None = None  # the engine's, smoothed

    def maybe_prefetch(
        self, request: ServeRequest, admitting: bool = False, ahead: bool = False
    ) -> bool:
        """Start a prefetch of what device and host lack now; whether one started.
        ``admitting``: the request is next to run; ``ahead``: it is next after those, and reads
        now what it would read then, if the prefetch share of host memory has room for all of
        it (the share past it stays for the reads of requests next to run)."""
        tree = self.tree
        if not tree.l3_enabled or not len(request.key):
            return False
        # This round's peek where the plan took one (the round's one look at the tree for
        # it); matched only when a read starts, which then takes the round's match instead of
        # an admission.
        peek = request.prefix_match if admitting or ahead else None
        cached = (peek or tree.peek_tiers(request.key)).total
        missing = len(request.key) - cached
        threshold = tree.prefetch_threshold_tokens
        short = tree.prefetch_shortfall_tokens(request.rid)
        short = short if (admitting or ahead) and not request.had_turn else 0
        # pages its last read kept that a running request's need took back (yield_reserved)
        gone = (admitting or ahead) and tree.prefetch_yielded(request.rid)
        unchanged = cached >= request.cached_at_submit and not gone
        if missing < threshold or (unchanged and short < threshold):
            request.cached_at_submit = min(request.cached_at_submit, cached)
            return False
        request.cached_at_submit = cached
        if not self._pays(missing):
            tree.metrics.add("prefetch_skipped_slow")
            return False
        match = tree.match_prefix(request.key, count_hits=False)
        mode = PrefetchMode(reserve=True, urgent=admitting, whole=ahead)
        return tree.prefetch_start(request.rid, request.key, match, mode)

    def short_of_l3(self, request: ServeRequest) -> bool:
        """Whether the request's last prefetch left pages in L3 for lack of host room, and it
        has not been next to run yet (it reads them back then)."""
        if request.had_turn:
            return False
        tree = self.tree
        return tree.prefetch_shortfall_tokens(request.rid) >= tree.prefetch_threshold_tokens

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens >= 64:
            rate = tokens / seconds
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate

    def _pays(self, tokens: int) -> bool:
        """Whether reading ``tokens`` from L3 is expected to beat computing them."""
        tree = self.tree
        if not self.skip_slow or tokens <= 0:
            return True
        read_rate, compute_rate = tree.l3_read_bytes_per_s, self.prefill_tokens_per_s
        if read_rate is None or compute_rate is None:
            return True  # nothing measured yet: try, and measure
        per_token = tree.page_bytes / tree.page_size
        return tokens * per_token / read_rate < tokens / compute_rate
