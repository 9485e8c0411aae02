"""An unreliable L3: the cache keeps serving exact KV, counts what failed and leaks nothing.

Faults come from :class:`FaultInjectionBackend` (errors, corrupt reads, stalls whose sleep is a
gate the test opens) or from bytes flipped in stored objects; dropped writes from a tiny write
queue behind a stalled writer. ``assert_clean`` checks that once idle nothing is locked or
reserved and every used device slot and host page belongs to a tree node.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from gated_kit import (
    Gate,
    GatedBackend,
    assert_clean,
    quiesce,
    seed_l3,
    start_prefetch,
    tokens,
    until,
)
from tier_kit import PAGE, Harness

from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import (
    FaultConfig,
    FaultInjectionBackend,
    FaultMode,
    Operation,
    SleepFn,
)
from hicache.keys import RadixKey
from hicache.tiering.common.config import PrefetchConfig, StorageConfig
from hicache.tiering.common.policies import PrefetchStopPolicy, TerminationReason
from hicache.tiering.l3.bundler import BundlePage
from hicache.tiering.l3.storage_tier import PrefetchOp

SEQ = tokens(1, 8)


async def faulty(
    policy: PrefetchStopPolicy = PrefetchStopPolicy.WAIT_COMPLETE,
    storage: StorageConfig | None = None,
    sleep: SleepFn = asyncio.sleep,
) -> tuple[Harness, FaultInjectionBackend]:
    backend = FaultInjectionBackend(MemoryBackend(), FaultConfig(), sleep=sleep)
    prefetch = PrefetchConfig(stop_policy=policy, threshold_tokens=PAGE, timeout_base_s=1.0)
    h = await Harness.build(backend=backend, prefetch=prefetch, storage=storage)
    return h, backend


def only(*ops: Operation, **config: object) -> FaultConfig:
    return FaultConfig(operations=frozenset(ops), **config)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def faulty_prefetch(
    faults: FaultConfig,
) -> AsyncIterator[tuple[Harness, FaultInjectionBackend, PrefetchOp]]:
    """L3 holding ``SEQ`` and then given ``faults``; a prefetch of ``SEQ`` whose reads have ended,
    after which the request may run. The harness is closed on the way out."""
    h, backend = await faulty()
    try:
        await seed_l3(h, SEQ)
        backend.set_faults(faults)
        prefetch = start_prefetch(h, "r", SEQ)
        await until(lambda: prefetch.reads_finished)
        assert h.tree.prefetcher.may_run("r") is True
        yield h, backend, prefetch
    finally:
        await h.close()


# ----- reads --------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [Operation.GET, Operation.EXISTS])
async def test_raising_reads_end_the_prefetch_and_the_request_recomputes(op: Operation) -> None:
    raising = only(op, fail_rate=1.0, fail_mode=FaultMode.RAISE)
    async with faulty_prefetch(raising) as (h, _, prefetch):
        assert prefetch.reason is TerminationReason.ERROR
        assert h.controller.metrics.counts["errors"] == 1
        assert h.controller.metrics.counts["prefetch_error"] == 1
        # Every page of the request was asked of L3 and none could be read.
        assert h.controller.metrics.counts["l3_read_failures"] == len(SEQ) // 4
        assert h.run_request("r", SEQ) == {"device": 0, "host": 0, "computed": 32}
        await assert_clean(h)


async def test_missing_objects_are_misses() -> None:
    missing = only(Operation.GET, fail_rate=1.0)  # get_into answers MISS
    async with faulty_prefetch(missing) as (h, _, prefetch):
        assert prefetch.completed_pages == 0 and h.controller.metrics.counts["missing_pages"] >= 1
        assert h.controller.metrics.counts["missing_pages"] >= 1
        assert h.controller.metrics.counts["l3_hit_tokens"] == 0
        assert h.run_request("r", SEQ)["computed"] == 32
        await assert_clean(h)


async def test_corrupt_reads_are_misses_and_the_kv_stays_exact() -> None:
    async with faulty_prefetch(only(Operation.GET, corrupt_rate=1.0)) as (h, backend, prefetch):
        assert prefetch.completed_pages == 0
        assert h.controller.metrics.counts["corrupt_pages"] >= 1
        assert h.controller.metrics.counts["corrupt_pages"] >= 1
        assert (await backend.stats())["injected_corruptions"] >= 1
        assert h.run_request("r", SEQ) == {"device": 0, "host": 0, "computed": 32}
        await assert_clean(h)


def _flip_stored_page(h: Harness, memory: MemoryBackend, probe: PrefetchOp, page: int) -> None:
    """Flip a payload byte of the stored object of ``SEQ``'s page ``page``."""
    candidate = probe.candidates[page]
    key = h.controller.bundler.keys(
        BundlePage(candidate.namespace, candidate.page_hash, {"kv": 0})
    )["kv"]
    data = memory._objects[key][0]
    data[len(data) - 7] ^= 0xFF


async def test_a_page_corrupted_at_rest_cuts_the_hit_there() -> None:
    memory = MemoryBackend()
    async with await Harness.build(
        backend=memory,
        prefetch=PrefetchConfig(
            stop_policy=PrefetchStopPolicy.WAIT_COMPLETE, threshold_tokens=PAGE
        ),
    ) as h:
        await seed_l3(h, SEQ)
        probe = start_prefetch(h, "probe", SEQ)  # for the page hashes; its pages are freed
        await quiesce(h)
        assert probe.completed_pages == 8
        h.tree.host_evictor.evict(10**6)
        _flip_stored_page(h, memory, probe, 3)
        prefetch = start_prefetch(h, "r", SEQ)
        await until(lambda: prefetch.reads_finished)
        assert h.tree.prefetcher.may_run("r") is True
        assert prefetch.completed_pages == 3 and h.controller.metrics.counts["corrupt_pages"] == 1
        assert h.controller.metrics.counts["corrupt_pages"] == 1
        # pages 0-2 come from L3 and must hold exactly the recomputed KV
        assert h.run_request("r", SEQ) == {"device": 0, "host": 12, "computed": 20}
        await assert_clean(h)


# ----- stalls past the deadline -------------------------------------------------------------------
def gated_sleep(gate: Gate) -> SleepFn:
    """A sleep that lasts until the test opens ``gate``: a stall of the test's choosing."""

    async def sleep(_seconds: float) -> None:
        await gate.wait()

    return sleep


@pytest.mark.parametrize("policy", list(PrefetchStopPolicy))
async def test_a_read_past_its_deadline_ends_the_wait_but_keeps_its_pages(
    policy: PrefetchStopPolicy,
) -> None:
    gate = Gate()
    h, backend = await faulty(policy, StorageConfig(op_deadline_s=0.05), gated_sleep(gate))
    try:
        await seed_l3(h, SEQ)
        backend.set_faults(only(Operation.GET, stall_rate=1.0))
        prefetch = start_prefetch(h, "r", SEQ)
        await until(lambda: h.controller.metrics.counts["timeouts"] == 1)
        assert prefetch.reason is TerminationReason.ERROR and not prefetch.reads_finished
        # nothing more will arrive: whatever the policy, the request need not wait for the
        # hung call (the fake clock has not moved, so no prefetch timeout is involved)
        assert h.tree.prefetcher.may_run("r") is True
        assert h.controller.metrics.counts["prefetch_error"] == 1
        assert h.run_request("r", SEQ)["computed"] == 32
        # ... but the late read may still land in its host pages: they stay reserved
        h.tree.check_events()
        assert h.host["kv"].used_pages == 16 and h.tree.prefetcher.pages_in_use == 8
        gate.open()
        await assert_clean(h)
        assert h.host["kv"].used_pages == 8  # the request's own backup only
    finally:
        gate.open()
        await h.close()


async def test_a_write_past_its_deadline_fails_and_keeps_its_pages_protected() -> None:
    gate = Gate()
    h, backend = await faulty(storage=StorageConfig(op_deadline_s=0.05), sleep=gated_sleep(gate))
    try:
        backend.set_faults(only(Operation.PUT, stall_rate=1.0))
        h.run_request("a", SEQ)
        await until(lambda: h.controller.metrics.counts["timeouts"] == 1)
        h.tree.check_events()
        assert h.host["kv"].protected_pages == 8  # the late put still reads them
        gate.open()
        await assert_clean(h)
        assert h.controller.metrics.counts["l3_write_failures"] == 8
        assert not any(n.in_storage for n in h.tree.all_nodes())
    finally:
        gate.open()
        await h.close()


# ----- writes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [FaultMode.RETURN, FaultMode.RAISE])
async def test_failed_writes_are_counted_and_retried_on_a_later_hit(mode: FaultMode) -> None:
    h, backend = await faulty()
    try:
        backend.set_faults(only(Operation.PUT, fail_rate=1.0, fail_mode=mode))
        h.run_request("a", SEQ)
        await assert_clean(h)
        counts = h.controller.metrics.counts
        assert counts["l3_write_failures"] == 8 and counts["pages_written_l3"] == 0
        assert counts["errors"] == (1 if mode is FaultMode.RAISE else 0)
        node = h.tree.all_nodes()[0]
        assert node.host_value is not None and not node.in_storage
        backend.set_faults(FaultConfig())
        h.tree.match_prefix(RadixKey(SEQ))  # a hit admits the page to L3 again
        await assert_clean(h)
        assert node.in_storage and counts["pages_written_l3"] == 8
    finally:
        await h.close()


async def test_a_failing_exists_check_still_writes() -> None:
    h, backend = await faulty()
    try:
        backend.set_faults(only(Operation.EXISTS, fail_rate=1.0, fail_mode=FaultMode.RAISE))
        h.run_request("a", SEQ)
        await assert_clean(h)
        counts = h.controller.metrics.counts
        assert counts["errors"] == 1 and counts["pages_written_l3"] == 8
        assert all(n.in_storage for n in h.tree.all_nodes())
    finally:
        await h.close()


async def test_a_full_write_queue_drops_writes_and_releases_their_pages() -> None:
    put = Gate()
    h = await Harness.build(
        backend=GatedBackend(MemoryBackend(), put=put),
        storage=StorageConfig(write_queue_pages=2, workers=1),
    )
    try:
        seqs = [tokens(1 + 100 * i, 2) for i in range(3)]
        h.run_request("a", seqs[0])
        await until(lambda: put.waiting == 1)  # the only writer is stuck on a's put
        h.run_request("b", seqs[1])  # queued: 2 pages, the queue is full
        h.run_request("c", seqs[2])  # worth no more than b: dropped
        assert h.controller.metrics.counts["dropped_writes"] == 2
        assert h.controller.storage.queued_pages == 2
        put.open()
        await assert_clean(h)
        stored = {tuple(memoryview(n.key).cast("I")[:1]): n.in_storage for n in h.tree.all_nodes()}
        assert stored == {(1,): True, (101,): True, (201,): False}
        assert h.controller.metrics.counts["pages_written_l3"] == 4
    finally:
        put.open()
        await h.close()
