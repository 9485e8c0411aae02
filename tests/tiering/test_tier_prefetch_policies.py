"""L3 prefetch: each stop policy against a fast, a slow and a stalled L3, and its limits.

The slow L3 is a :class:`LatencyBackend` sleeping on the harness's fake clock, the stalled one a
:class:`GatedBackend` whose reads wait until the test releases them; the prefetch timeout runs on
the same fake clock, so nothing depends on how fast the machine is. Every request that uses
prefetched pages goes through ``run_request``, which checks their KV against a recompute.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from clock_kit import FakeClock
from gated_kit import Gate, GatedBackend, quiesce, seed_l3, start_prefetch, tokens, until
from tier_kit import PAGE, Harness

from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import LatencyBackend, LatencyConfig
from hicache.keys import RadixKey
from hicache.tiering.common.config import PrefetchConfig, TierConfig
from hicache.tiering.common.policies import PrefetchStopPolicy, TerminationReason
from hicache.tiering.l3.storage_tier import PrefetchOp

BEST, WAIT, TIMEOUT = (
    PrefetchStopPolicy.BEST_EFFORT,
    PrefetchStopPolicy.WAIT_COMPLETE,
    PrefetchStopPolicy.TIMEOUT,
)
SEQ = tokens(1, 8)  # 8 pages, 32 tokens


async def build(
    policy: PrefetchStopPolicy, backend: MemoryBackend | GatedBackend | LatencyBackend, **kw: object
) -> Harness:
    host_pages = int(kw.pop("host_pages", 64))  # type: ignore[call-overload]
    options: dict = {"threshold_tokens": PAGE, "timeout_base_s": 1.0, **kw}
    prefetch = PrefetchConfig(stop_policy=policy, **options)
    return await Harness.build(backend=backend, prefetch=prefetch, host_pages=host_pages)


def host_used(h: Harness) -> int:
    return h.host["kv"].used_pages


def counts(h: Harness) -> Counter[str]:
    return h.controller.metrics.counts


async def finish(h: Harness) -> None:
    """Let everything run out, then check nothing is held."""
    await quiesce(h)
    assert h.usage() == {
        "protected": 0,
        "host_protected": 0,
        "prefetch_pages": 0,
        "prefetches": 0,
        "locked_nodes": [],
    }


# ----- fast L3: every policy waits for nothing and gets everything -------------------------------
@pytest.mark.parametrize("policy", [BEST, WAIT, TIMEOUT])
async def test_fast_l3_completes_under_every_policy(policy: PrefetchStopPolicy) -> None:
    async with await build(policy, MemoryBackend()) as h:
        await seed_l3(h, SEQ)
        op = start_prefetch(h, "r", SEQ)
        await until(lambda: op.reads_finished)
        assert h.tree.prefetcher.may_run("r") is True
        assert op.reason is TerminationReason.COMPLETE and op.taken_pages == 8
        assert counts(h)["prefetch_complete"] == 1 and counts(h)["l3_hit_tokens"] == 32
        assert h.run_request("r", SEQ) == {"device": 0, "host": 32, "computed": 0}
        await finish(h)
        assert host_used(h) == 8  # the prefetched pages, now a host node, and nothing else


# ----- slow L3: every call takes fake time, so the test decides when each one ends ---------------
async def slow_l3(policy: PrefetchStopPolicy, latency_s: float) -> tuple[Harness, LatencyBackend]:
    """L3 holding ``SEQ`` behind a link whose every call takes ``latency_s`` of fake time."""
    clocks: list[FakeClock] = []

    async def sleep(seconds: float) -> None:  # returns once the harness clock has moved on
        wake = clocks[0].now + seconds
        while clocks[0].now < wake:
            await asyncio.sleep(0)

    slow = LatencyBackend(MemoryBackend(), sleep=sleep, clock=lambda: clocks[0].now)
    h = await build(policy, slow)
    clocks.append(h.clock)
    await seed_l3(h, SEQ)  # no latency yet
    slow.config = LatencyConfig(latency_s=latency_s)
    return h, slow


async def turns(n: int = 20) -> None:
    """Event-loop turns: enough for a fast L3 to answer everything, none of fake time."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("policy", [BEST, WAIT, TIMEOUT])
async def test_slow_l3_within_the_timeout(policy: PrefetchStopPolicy) -> None:
    # exists then one read, 0.4 s each: done at 0.8 s, before the 1.003 s timeout
    h, slow = await slow_l3(policy, 0.4)
    try:
        op = start_prefetch(h, "r", SEQ)
        await turns()
        assert op.hit_pages is None and not op.reads_finished
        ready = h.tree.prefetcher.may_run("r")
        if policy is BEST:  # at once, with what has arrived: nothing yet
            assert ready is True and op.taken_pages == 0
            assert counts(h)["prefetch_best_effort"] == 1 and counts(h)["l3_miss_tokens"] == 32
            h.clock.advance(0.4)  # L3 answers; a stopped prefetch reads nothing after that
            await until(lambda: op.reads_finished)
            assert op.completed_pages == 0 and host_used(h) == 0
            slow.config = LatencyConfig()  # the request's own L3 writes need not wait
            assert h.run_request("r", SEQ)["computed"] == 32
        else:
            assert ready is False
            h.clock.advance(0.4)  # L3 answered: 8 pages; the read is under way
            await until(lambda: op.hit_pages == 8)
            await turns()
            assert h.tree.prefetcher.may_run("r") is False and op.completed_pages == 0
            h.clock.advance(0.4)
            await until(lambda: op.reads_finished)
            assert h.tree.prefetcher.may_run("r") is True
            assert op.reason is TerminationReason.COMPLETE
            assert h.run_request("r", SEQ) == {"device": 0, "host": 32, "computed": 0}
        await finish(h)
    finally:
        await h.close()


async def test_slow_l3_past_the_timeout() -> None:
    # 0.7 s a call: L3 answers at 0.7 s, the read would end at 1.4 s; the timeout is 1.003 s
    h, slow = await slow_l3(TIMEOUT, 0.7)
    try:
        op = start_prefetch(h, "r", SEQ)
        await turns()  # the exists call is made, and waits
        h.clock.advance(0.7)
        await until(lambda: op.hit_pages == 8)
        assert h.tree.prefetcher.may_run("r") is False
        h.clock.advance(0.3)  # 1.0 s
        assert h.tree.prefetcher.may_run("r") is False
        h.clock.advance(0.01)
        assert h.tree.prefetcher.may_run("r") is True
        assert op.reason is TerminationReason.TIMEOUT and op.taken_pages == 0
        assert host_used(h) == 8  # the read still lands in them
        await turns()
        h.clock.advance(1.0)
        await until(lambda: op.reads_finished)
        await finish(h)
        assert host_used(h) == 0 and op.completed_pages == 0
        slow.config = LatencyConfig()
        assert h.run_request("r", SEQ)["computed"] == 32
    finally:
        await h.close()


# ----- stalled L3: reads wait at a gate -----------------------------------------------------------
async def stalled(policy: PrefetchStopPolicy, **kw: object) -> tuple[Harness, Gate]:
    gate = Gate(opened=True)
    h = await build(policy, GatedBackend(MemoryBackend(), get=gate), **kw)
    await seed_l3(h, SEQ, tokens(1000, 8))
    gate.shut()  # seeding is done: from now on reads wait for the test
    return h, gate


@contextlib.asynccontextmanager
async def stalled_prefetch(
    policy: PrefetchStopPolicy, seq: list[int] = SEQ, **kw: object
) -> AsyncIterator[tuple[Harness, Gate, PrefetchOp]]:
    """``stalled``, with the prefetch of ``seq`` started and its first read waiting at the gate;
    the harness is closed on the way out."""
    h, gate = await stalled(policy, **kw)
    try:
        op = start_prefetch(h, "r", seq)
        await until(lambda: gate.waiting == 1)
        yield h, gate, op
    finally:
        await h.close()


async def test_best_effort_inserts_only_what_arrived_and_frees_the_rest_after_its_reads() -> None:
    async with stalled_prefetch(BEST, batch_pages=2) as (h, gate, op):
        gate.release()  # the first batch of 2 pages arrives; the second waits
        await until(lambda: op.completed_pages == 2 and gate.waiting == 1)
        assert h.tree.prefetcher.may_run("r") is True
        assert op.reason is TerminationReason.BEST_EFFORT and op.taken_pages == 2
        match = h.tree.match_prefix(RadixKey(SEQ))
        assert match.host_hit_length == 8
        # the 6 pages of the batches not taken are still reserved: a read may land in them
        assert host_used(h) == 8 and h.tree.prefetcher.pages_in_use == 6
        h.tree.check_events()
        assert host_used(h) == 8
        gate.open()
        await finish(h)
        assert host_used(h) == 2 and op.completed_pages == 2  # late batches are not counted
        assert h.run_request("r", SEQ) == {"device": 0, "host": 8, "computed": 24}
        assert counts(h)["prefetch_best_effort"] == 1
        assert counts(h)["l3_hit_tokens"] == 8 and counts(h)["l3_miss_tokens"] == 24


async def test_wait_complete_waits_however_long_the_reads_take() -> None:
    async with stalled_prefetch(WAIT) as (h, gate, op):
        for _ in range(3):
            h.clock.advance(1000.0)
            assert h.tree.prefetcher.may_run("r") is False
            h.tree.check_events()
        assert op.taken_pages is None
        gate.open()
        await until(lambda: op.reads_finished)
        assert h.tree.prefetcher.may_run("r") is True
        assert counts(h)["prefetch_complete"] == 1 and counts(h)["l3_hit_tokens"] == 32
        assert h.run_request("r", SEQ)["host"] == 32
        await finish(h)


async def test_timeout_uses_the_hit_tokens_of_the_formula() -> None:
    # 8 pages in L3 of 16 asked for: deadline = 1 + 64 * 32 / 1024 = 3 s (5 s if it used 64)
    asked = SEQ + tokens(5000, 8)
    async with stalled_prefetch(TIMEOUT, timeout_per_1k_tokens_s=64.0, seq=asked) as (h, gate, op):
        assert op.hit_pages == 8
        h.clock.advance(2.99)
        assert h.tree.prefetcher.may_run("r") is False
        h.clock.advance(0.01)
        assert h.tree.prefetcher.may_run("r") is True
        assert op.reason is TerminationReason.TIMEOUT and op.taken_pages == 0
        assert counts(h)["prefetch_timeout"] == 1
        assert h.tree.prefetcher.pages_in_use == 8 and host_used(h) == 8  # still being read
        gate.open()
        await finish(h)
        assert host_used(h) == 0
        assert h.run_request("r", asked)["computed"] == 64


async def test_timeout_is_capped_by_its_max() -> None:
    capped = stalled_prefetch(TIMEOUT, timeout_per_1k_tokens_s=1000.0, timeout_max_s=4.0)
    async with capped as (h, gate, op):
        h.clock.advance(3.9)
        assert h.tree.prefetcher.may_run("r") is False
        h.clock.advance(0.1)
        assert h.tree.prefetcher.may_run("r") is True and op.reason is TerminationReason.TIMEOUT
        gate.open()
        await finish(h)


async def test_timeout_keeps_the_batches_that_arrived() -> None:
    async with stalled_prefetch(TIMEOUT, batch_pages=1) as (h, gate, op):
        gate.release(3)
        await until(lambda: op.completed_pages == 3 and gate.waiting == 1)
        h.clock.advance(100.0)
        assert h.tree.prefetcher.may_run("r") is True
        assert op.taken_pages == 3
        gate.open()
        await finish(h)
        assert host_used(h) == 3
        assert h.run_request("r", SEQ) == {"device": 0, "host": 12, "computed": 20}


async def test_each_batch_is_acknowledged_on_its_own() -> None:
    h, gate = await stalled(WAIT, batch_pages=1)
    try:
        op = start_prefetch(h, "r", SEQ)
        seen = []
        for i in range(8):
            await until(lambda i=i: gate.waiting == 1 and gate.passed == i)  # type: ignore[misc]
            seen.append(op.completed_pages)
            assert h.tree.prefetcher.may_run("r") is False
            gate.release()
        await until(lambda: op.reads_finished)
        assert seen == list(range(8)) and op.completed_pages == 8
        assert gate.passed == 8  # one backend call per page
        assert h.tree.prefetcher.may_run("r") is True
        assert h.run_request("r", SEQ)["host"] == 32
        await finish(h)
    finally:
        await h.close()


# ----- what is not prefetched ---------------------------------------------------------------------
async def test_a_candidate_under_the_threshold_is_not_started() -> None:
    async with await build(WAIT, MemoryBackend(), threshold_tokens=16) as h:
        await seed_l3(h, SEQ)
        short = [*SEQ[:12], 9999]  # 3 whole pages (12 tokens) < 16
        key = RadixKey(short)
        assert h.tree.prefetcher.start("s", key, h.tree.match_prefix(key)) is False
        assert counts(h)["prefetch_skipped_small"] == 1 and counts(h)["prefetch_started"] == 0
        assert h.tree.prefetcher.may_run("s") is True  # nothing to wait for
        # a long enough one starts
        key = RadixKey(SEQ)
        assert h.tree.prefetcher.start("l", key, h.tree.match_prefix(key)) is True
        await finish(h)


async def test_l3_holding_less_than_the_threshold_is_not_read() -> None:
    async with await build(WAIT, MemoryBackend(), threshold_tokens=16) as h:
        await seed_l3(h, SEQ[:8])  # L3 holds 2 pages of the 8 asked for
        op = start_prefetch(h, "r", SEQ)
        await until(lambda: op.reads_finished)
        assert op.hit_pages == 2 and op.host_pages == []
        assert h.tree.prefetcher.may_run("r") is True
        assert op.reason is TerminationReason.BELOW_THRESHOLD
        assert counts(h)["prefetch_below_threshold"] == 1 and counts(h)["l3_hit_tokens"] == 0
        assert counts(h)["bytes_l3_to_host"] == 0
        await finish(h)
        assert host_used(h) == 0


async def test_the_capacity_share_cuts_and_then_refuses() -> None:
    # 16 host pages, share 0.25: prefetches may hold 4 pages in all
    h, gate = await stalled(WAIT, host_pages=16, capacity_share=0.25)
    try:
        first = start_prefetch(h, "a", SEQ)
        await until(lambda: gate.waiting == 1)
        assert first.hit_pages == 8 and len(first.host_pages) == 4  # cut to the share
        assert counts(h)["prefetch_skipped_capacity"] == 1
        second = start_prefetch(h, "b", tokens(1000, 8))
        await until(lambda: second.reads_finished)
        assert second.host_pages == [] and gate.waiting == 1
        assert h.tree.prefetcher.may_run("b") is True
        assert second.reason is TerminationReason.NO_HOST_MEMORY
        assert counts(h)["prefetch_skipped_capacity"] == 2
        assert counts(h)["prefetch_no_host_memory"] == 1
        gate.open()
        await until(lambda: first.reads_finished)
        assert h.tree.prefetcher.may_run("a") is True
        assert first.reason is TerminationReason.COMPLETE and first.taken_pages == 4
        assert h.run_request("a", SEQ) == {"device": 0, "host": 16, "computed": 16}
        await finish(h)
    finally:
        await h.close()


async def test_prefetch_starts_after_the_device_and_host_hits() -> None:
    async with await build(WAIT, MemoryBackend()) as h:
        await seed_l3(h, SEQ)
        h.run_request("w1", SEQ[:4])  # recomputed: page 0 on the device
        h.run_request("w2", SEQ[:8])  # page 1 below it
        await h.settle()
        assert h.tree.evict(PAGE) == PAGE  # page 1 (the leaf) goes down to host
        key = RadixKey(SEQ)
        match = h.tree.match_prefix(key)
        assert (match.prefix_len, match.host_hit_length) == (4, 4)
        assert h.tree.prefetcher.start("r", key, match)
        op = h.tree.prefetcher.running["r"]
        assert len(op.candidates) == 6 and op.candidates[0].page_index == 2
        await until(lambda: op.reads_finished)
        assert h.tree.prefetcher.may_run("r") is True
        assert h.run_request("r", SEQ) == {"device": 4, "host": 28, "computed": 0}
        await finish(h)


async def test_prefetch_is_off_when_disabled_or_without_l3() -> None:
    async with await Harness.build(prefetch=PrefetchConfig(threshold_tokens=PAGE)) as h:  # no L3
        key = RadixKey(SEQ)
        assert h.tree.prefetcher.start("r", key, h.tree.match_prefix(key)) is False
    async with await Harness.build(
        backend=MemoryBackend(),
        prefetch=PrefetchConfig(enabled=False, threshold_tokens=PAGE),
        tiers=TierConfig(),
    ) as h:
        await seed_l3(h, SEQ)
        key = RadixKey(SEQ)
        assert h.tree.prefetcher.start("r", key, h.tree.match_prefix(key)) is False
        assert counts(h)["prefetch_started"] == 0
