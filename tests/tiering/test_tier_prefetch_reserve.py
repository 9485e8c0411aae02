"""Prefetches that keep their pages for their request, and prefetches that wait their turn.

A serving engine prefetches for every queued request at once when a burst arrives; the requests
run later, a few at a time. What a ``reserve`` prefetch inserted must still be on host when its
request runs (host eviction may not take it), within ``capacity_share``; a prefetch that got less
than L3 held says so (``shortfall_tokens``) so the engine can read the rest once room frees. At
most ``concurrency`` prefetches talk to L3 at once, in the order they started.
"""

from __future__ import annotations

from tier_gated import Gate, GatedBackend, quiesce, seed_l3, tokens, until
from tier_harness import PAGE, Harness

from hicache.backends.memory import MemoryBackend
from hicache.keys import RadixKey
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


async def test_reserved_pages_survive_host_eviction_until_released() -> None:
    h = await build(MemoryBackend())
    try:
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
    finally:
        await h.close()


async def test_yielded_reservations_may_be_evicted_and_later_ones_still_reserve() -> None:
    """A running request short of host memory makes the prefetches of queued ones give up
    what they keep (it stays in L3): host eviction may take it then; the request's credit
    (its L3 hit) stays, and a later prefetch of it keeps its pages again."""
    h = await build(MemoryBackend())
    try:
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
    finally:
        await h.close()


async def test_a_queued_request_reads_yielded_pages_again_at_its_turn() -> None:
    """The engine's read-back decision: a queued request whose kept pages were yielded and
    evicted reads them again when it is next to run (its cached prefix is no shorter than at
    its first read, which alone would not start one); without the yield it would not."""
    h = await build(MemoryBackend())
    try:
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
    finally:
        await h.close()


async def test_a_prefetch_short_of_host_room_leaves_a_shortfall() -> None:
    # capacity_share 0.25 of 16 host pages: room for 4 of the 8 pages L3 holds
    h = await build(MemoryBackend(), host_pages=16, capacity_share=0.25)
    try:
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
    finally:
        await h.close()


async def test_prefetches_take_turns_in_the_order_they_started() -> None:
    gate = Gate(opened=True)
    h = await build(GatedBackend(MemoryBackend(), get=gate), concurrency=1)
    try:
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
    finally:
        await h.close()
