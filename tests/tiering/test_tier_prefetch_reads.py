"""What a prefetch reads from L3 and what it keeps: how much it asks L3, what it holds for its
request, and its turn.

- The lookup: in batches that double from ``batch_pages``, stopping after the first page whose
  anchor objects L3 lacks (no usable prefix reaches past it), with the same hit as asking about
  every page.
- Keeping: a serving engine prefetches for every queued request at once when a burst arrives;
  the requests run later, a few at a time. What a ``reserve`` prefetch inserted must still be on
  host when its request runs (host eviction may not take it), within ``capacity_share``; a
  prefetch that got less than L3 held says so (``shortfall_tokens``) so the engine can read the
  rest once room frees.
- Turns: at most ``concurrency`` prefetches talk to L3 at once, in the order they started.
"""

from __future__ import annotations

import pathlib

import pytest
from gated_kit import Gate, GatedBackend, quiesce, seed_l3, start_prefetch, tokens, until
from pool_kit import PoolKit
from tier_kit import PAGE, Harness

from hicache.backends.base import StorageBackend
from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import WrapperBackend
from hicache.keys import RadixKey
from hicache.pools.presets import PoolPreset
from hicache.serving.l3_reads import L3Reads
from hicache.serving.request import ServeRequest
from hicache.tiering.common.config import PrefetchConfig
from hicache.tiering.common.policies import PrefetchStopPolicy, TerminationReason

SEQ = tokens(1, 8)  # 8 pages of PAGE tokens
OTHER = tokens(500, 8)


async def build(
    backend: MemoryBackend | GatedBackend,
    host_pages: int = 64,
    capacity_share: float = 0.5,
    concurrency: int = 4,
) -> Harness:
    prefetch = PrefetchConfig(
        stop_policy=PrefetchStopPolicy.WAIT_COMPLETE,
        threshold_tokens=PAGE,
        capacity_share=capacity_share,
        concurrency=concurrency,
    )
    return await Harness.build(backend=backend, prefetch=prefetch, host_pages=host_pages)


def start(h: Harness, rid: str, seq: list[int], reserve: bool) -> None:
    key = RadixKey(seq)
    assert h.tree.prefetcher.start(rid, key, h.tree.match_prefix(key), reserve=reserve)


async def settled(h: Harness, rid: str) -> None:
    """Wait for ``rid``'s reads, then let the tree take what arrived (as ``may_run`` does)."""
    op = h.tree.prefetcher.running[rid]
    await until(lambda: op.reads_finished)
    assert h.tree.prefetcher.may_run(rid) is True


def host_hit(h: Harness, seq: list[int]) -> int:
    return h.tree.match_prefix(RadixKey(seq)).host_hit_length


class CountedLookups(WrapperBackend):
    """Records the keys of every ``exists`` call."""

    name = "counted-lookups"

    def __init__(self, inner: StorageBackend | None = None) -> None:
        super().__init__(inner or MemoryBackend())
        self.asked: list[list[str]] = []

    async def _exists(self, keys: list[str]) -> list[bool]:
        self.asked.append(list(keys))
        return await self.inner.exists(keys)


async def _prefetched(
    preset: PoolPreset, seeded_pages: int, asked_pages: int, batch_pages: int
) -> tuple[int, list[int], int]:
    """Seed L3 with ``seeded_pages`` pages, then prefetch ``asked_pages`` pages that start with
    them: (pages L3 was found to hold, pages asked about per ``exists`` call, objects per page)."""
    backend = CountedLookups()
    prefetch = PrefetchConfig(threshold_tokens=PAGE, timeout_base_s=1.0, batch_pages=batch_pages)
    async with await Harness.build(
        backend=backend, prefetch=prefetch, pool_preset=preset, device_tokens=512, host_pages=256
    ) as h:
        seq = tokens(1, asked_pages)
        await seed_l3(h, seq[: seeded_pages * PAGE])
        per_page = len(h.controller.storage.bundler.host_pools)
        backend.asked.clear()
        counts = h.controller.metrics.counts
        before = counts["l3_lookup_pages"], counts["l3_lookup_candidates"]
        op = start_prefetch(h, "r", seq)
        await until(lambda: op.reads_finished)
        await quiesce(h)
        assert op.hit_pages is not None
        asked = sum(len(keys) for keys in backend.asked) // per_page
        # The counters the serving report shows: pages asked about, of the candidates.
        assert (counts["l3_lookup_pages"], counts["l3_lookup_candidates"]) == (
            before[0] + asked,
            before[1] + len(op.candidates),
        )
        return op.hit_pages, [len(keys) // per_page for keys in backend.asked], per_page


# ----- the lookup: how much a prefetch asks L3 ----------------------------------------------------
async def test_a_prefetch_stops_asking_after_the_first_page_l3_lacks() -> None:
    hit, asked, _ = await _prefetched(PoolPreset.DENSE, 4, 64, batch_pages=8)
    assert hit == 4
    assert asked == [8]  # one batch held the miss; the other 56 pages were never asked about


async def test_the_batches_double_until_one_holds_the_miss() -> None:
    hit, asked, _ = await _prefetched(PoolPreset.DENSE, 20, 64, batch_pages=4)
    assert hit == 20
    assert asked == [4, 8, 16]  # 28 pages asked; the miss is page 21, in the third batch


async def test_a_prefetch_of_pages_all_in_l3_asks_about_each_once() -> None:
    hit, asked, _ = await _prefetched(PoolPreset.DENSE, 24, 24, batch_pages=4)
    assert hit == 24
    assert asked == [4, 8, 12]  # the last batch is what is left


async def test_a_sidecar_stops_the_lookup_like_its_anchor() -> None:
    """DSA: a page is usable only with both its latent and its indexer keys; the hit is what
    the planner gives when asked about every page."""
    hit_all, asked_all, per_page = await _prefetched(PoolPreset.DSA, 12, 12, batch_pages=64)
    assert asked_all == [12] and per_page == 2
    hit, asked, _ = await _prefetched(PoolPreset.DSA, 12, 64, batch_pages=4)
    assert hit == hit_all == 12
    assert asked == [4, 8, 16]


@pytest.mark.parametrize("kind", [PoolPreset.SWA, PoolPreset.HYBRID])
async def test_windows_and_snapshots_are_asked_about_up_to_the_anchors_first_miss(
    kind: PoolPreset, tmp_path: pathlib.Path
) -> None:
    """A stored prefix of 48 tokens (windows or snapshots at 16, 32 and 48), then a query that
    shares 44 of them and goes on for 40 pages: the lookup ends in the first batch of 32 pages
    (the anchor misses at page 12), and the hit is the last usable end before it, 32 tokens."""
    url = f"file://{tmp_path / 'store'}"
    stored = list(range(48))
    async with await PoolKit.build(kind, url=url) as kit:
        kit.cache(stored, snapshots=(16, 32))
        assert kit.fetch(stored) == (48, 0)  # a reuse: each window on the path may go to L3
        await kit.tree.quiesce(10)
    again = await PoolKit.build(kind, url=url)
    storage = again.controller.storage
    assert storage.backend is not None
    counted = CountedLookups(storage.backend)
    storage.backend = counted
    try:
        query = [*stored[:44], *range(7000, 7000 + 40 * PAGE)]
        match = again.tree.match_prefix(RadixKey(query), count_hits=False)
        assert again.tree.prefetcher.start("r1", RadixKey(query), match)
        await again.tree.quiesce(10)
        per_page = len(storage.bundler.host_pools)
        assert [len(keys) // per_page for keys in counted.asked] == [32]  # of 51 candidates
        assert again.fetch(query) == (0, 32)
        again.recount()
    finally:
        storage.backend = counted.inner
        await again.close()


# ----- what a prefetch keeps for its request ------------------------------------------------------
async def test_reserved_pages_survive_host_eviction_until_released() -> None:
    async with await build(MemoryBackend()) as h:
        await seed_l3(h, SEQ, OTHER)
        start(h, "kept", SEQ, reserve=True)
        start(h, "plain", OTHER, reserve=False)
        await settled(h, "kept")
        await settled(h, "plain")
        prefetcher = h.tree.prefetcher
        assert prefetcher.pages_in_use == 8  # the reserved ones still count against the share
        assert prefetcher.room_pages == 32 - 8  # capacity_share 0.5 of 64 host pages
        h.tree.host_evictor.evict(10**6)
        assert host_hit(h, SEQ) == len(SEQ)  # kept for its request
        assert host_hit(h, OTHER) == 0  # an unreserved prefetch's pages are fair game
        assert prefetcher.release("kept") == len(SEQ)  # its L3 hit, in tokens
        assert prefetcher.pages_in_use == 0 and prefetcher.release("kept") == 0
        h.tree.host_evictor.evict(10**6)
        assert host_hit(h, SEQ) == 0 and h.host["kv"].used_pages == 0
        await quiesce(h)


async def test_yielded_reservations_may_be_evicted_and_later_ones_still_reserve() -> None:
    """A running request short of host memory makes the prefetches of queued ones give up
    what they keep (it stays in L3): host eviction may take it then; the request's credit
    (its L3 hit) stays, and a later prefetch of it keeps its pages again."""
    async with await build(MemoryBackend()) as h:
        await seed_l3(h, SEQ)
        start(h, "queued", SEQ, reserve=True)
        await settled(h, "queued")
        prefetcher = h.tree.prefetcher
        assert prefetcher.yield_reserved() == 8 and prefetcher.pages_in_use == 0
        assert prefetcher.yield_reserved() == 0
        h.tree.host_evictor.evict(10**6)
        assert host_hit(h, SEQ) == 0 and h.host["kv"].used_pages == 0
        start(h, "queued", SEQ, reserve=True)  # its turn comes: read again, kept again
        await settled(h, "queued")
        h.tree.host_evictor.evict(10**6)
        assert host_hit(h, SEQ) == len(SEQ)
        assert prefetcher.release("queued") == 2 * len(SEQ)  # both reads' tokens
        await quiesce(h)


async def test_a_queued_request_reads_yielded_pages_again_at_its_turn() -> None:
    """The engine's read-back decision: a queued request whose kept pages were yielded and
    evicted reads them again when it is next to run (its cached prefix is no shorter than at
    its first read, which alone would not start one); without the yield it would not."""
    async with await build(MemoryBackend()) as h:
        await seed_l3(h, SEQ)
        reads = L3Reads(h.tree, skip_slow=False)
        request = ServeRequest("queued", [*SEQ, 7], 1)  # its key: SEQ
        assert reads.maybe_prefetch(request)  # at arrival
        await settled(h, "queued")
        prefetcher = h.tree.prefetcher
        assert not prefetcher.yielded("queued")
        assert not reads.maybe_prefetch(request, admitting=True)  # all on host: nothing to read
        prefetcher.yield_reserved()
        h.tree.host_evictor.evict(10**6)
        assert host_hit(h, SEQ) == 0 and prefetcher.yielded("queued")
        assert reads.maybe_prefetch(request, admitting=True)
        assert not prefetcher.yielded("queued")
        await settled(h, "queued")
        assert host_hit(h, SEQ) == len(SEQ)
        prefetcher.release("queued")
        await quiesce(h)


async def test_a_prefetch_short_of_host_room_leaves_a_shortfall() -> None:
    # capacity_share 0.25 of 16 host pages: room for 4 of the 8 pages L3 holds
    async with await build(MemoryBackend(), host_pages=16, capacity_share=0.25) as h:
        await seed_l3(h, SEQ)
        start(h, "r", SEQ, reserve=True)
        await settled(h, "r")
        prefetcher = h.tree.prefetcher
        assert host_hit(h, SEQ) == 4 * PAGE
        assert prefetcher.shortfall_tokens("r") == 4 * PAGE and prefetcher.room_pages == 0
        # The rest, read once its first part is released (admitted) and room is back:
        assert prefetcher.release("r") == 4 * PAGE
        assert prefetcher.shortfall_tokens("r") == 0 and prefetcher.room_pages == 4
        start(h, "r", SEQ, reserve=True)
        await settled(h, "r")
        assert host_hit(h, SEQ) == len(SEQ) and prefetcher.shortfall_tokens("r") == 0
        assert prefetcher.release("r") == 4 * PAGE
        await quiesce(h)


# ----- turns --------------------------------------------------------------------------------------
async def test_prefetches_take_turns_in_the_order_they_started() -> None:
    gate = Gate(opened=True)
    async with await build(GatedBackend(MemoryBackend(), get=gate), concurrency=1) as h:
        await seed_l3(h, SEQ, OTHER, tokens(900, 8))
        gate.shut()
        start(h, "first", SEQ, reserve=False)
        start(h, "second", OTHER, reserve=False)
        start(h, "stopped", tokens(900, 8), reserve=False)
        running = h.tree.prefetcher.running
        first, second, stopped = running["first"], running["second"], running["stopped"]
        await until(lambda: gate.waiting == 1)  # the first one reads; the others wait their turn
        assert first.hit_pages == 8 and second.hit_pages is None and stopped.hit_pages is None
        h.tree.prefetcher.terminate("stopped")  # stopped while waiting: it will read nothing
        gate.release()
        await until(lambda: first.reads_finished and gate.waiting == 1)
        assert second.hit_pages == 8 and not second.reads_finished
        gate.open()
        await until(lambda: second.reads_finished and stopped.reads_finished)
        assert stopped.hit_pages is None and stopped.completed_pages == 0
        assert stopped.reason is TerminationReason.ABORTED
        await quiesce(h)
        assert host_hit(h, SEQ) == len(SEQ) and host_hit(h, OTHER) == len(OTHER)
        assert host_hit(h, tokens(900, 8)) == 0
