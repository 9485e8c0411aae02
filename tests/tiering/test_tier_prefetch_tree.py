"""A prefetch meets the tree: pages cached meanwhile, a prefix evicted meanwhile, its anchor
under host pressure, pool groups with sidecars, shutting down with reads in flight, and the
write paths (write_back, hit-threshold admission) that fill L3 for it."""

from __future__ import annotations

import asyncio
import pathlib

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
from hicache.keys import RadixKey
from hicache.pools.presets import PoolPreset
from hicache.tiering.common.config import PrefetchConfig, StorageConfig, TierConfig
from hicache.tiering.common.policies import L3Admission, PrefetchStopPolicy, WritePolicy

SEQ = tokens(1, 8)
WAIT = PrefetchConfig(stop_policy=PrefetchStopPolicy.WAIT_COMPLETE, threshold_tokens=PAGE)


async def gated(**kw: object) -> tuple[Harness, Gate]:
    """A harness whose L3 holds ``SEQ`` only, with its prefetch reads stopped at a gate."""
    gate = Gate(opened=True)
    # The writer's read-back of pages L3 holds (check_present) would wait at the gate too and
    # hold the recomputed pages' writes: these tests stop the prefetch's reads only.
    storage = StorageConfig(check_present=False)
    backend = GatedBackend(MemoryBackend(), get=gate)
    h = await Harness.build(backend=backend, prefetch=WAIT, storage=storage, **kw)  # type: ignore[arg-type]
    await seed_l3(h, SEQ)
    gate.shut()
    return h, gate


async def _prefetch_all_of_seq(h: Harness) -> None:
    """Prefetch all 8 pages of ``SEQ`` from L3; the request then finds them all on host."""
    op = start_prefetch(h, "r", SEQ)
    await until(lambda: op.reads_finished)
    assert h.tree.prefetcher.may_run("r") is True and op.completed_pages == 8
    assert h.run_request("r", SEQ) == {"device": 0, "host": 32, "computed": 0}
    await assert_clean(h)


@pytest.mark.parametrize("cached", [8, 16, 32])
async def test_pages_cached_meanwhile_are_freed_not_doubled(cached: int) -> None:
    h, gate = await gated()
    try:
        op = start_prefetch(h, "r", SEQ)
        await until(lambda: gate.waiting == 1)
        h.run_request("other", SEQ[:cached])  # computes what the prefetch is reading
        h.tree.check_events()
        gate.open()
        await until(lambda: op.reads_finished)
        assert h.tree.prefetcher.may_run("r") is True
        await assert_clean(h)
        assert h.host["kv"].used_pages == 8  # each page once: the backup, or the prefetched copy
        assert h.controller.metrics.counts["l3_hit_tokens"] == 32 - cached  # inserted ones only
        want = {"device": cached, "host": 32 - cached, "computed": 0}
        assert h.run_request("r", SEQ) == want  # the prefetched pages hang at the right place
        assert (
            h.tree.prefetcher.start("x", RadixKey(SEQ), h.tree.match_prefix(RadixKey(SEQ))) is False
        )
    finally:
        gate.open()
        await h.close()


async def _device_only_prefix(tmp_path: pathlib.Path) -> Harness:
    """L3 holds ``SEQ``; the tree holds its first 2 pages on the device only (no host copy)."""
    url = f"file://{tmp_path}/l3"
    async with await Harness.build(url=url) as writer:
        writer.run_request("a", SEQ)
        await quiesce(writer)
    never = TierConfig(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold=100)
    h = await Harness.build(url=url, prefetch=WAIT, tiers=never)
    h.run_request("w", SEQ[:8])
    return h


async def test_prefetched_pages_whose_prefix_was_evicted_are_freed(tmp_path: pathlib.Path) -> None:
    async with await _device_only_prefix(tmp_path) as h:
        op = start_prefetch(h, "r", SEQ)
        assert op.candidates[0].page_index == 2
        assert h.tree.evict(10**6) == 8  # the prefix is gone: it was on the device only
        await until(lambda: op.reads_finished)
        assert op.completed_pages == 6
        assert h.tree.prefetcher.may_run("r") is True
        await assert_clean(h)
        assert h.host["kv"].used_pages == 0 and not h.tree.all_nodes()
        assert h.run_request("r", SEQ)["computed"] == 32


async def test_pages_not_inserted_are_not_counted_as_l3_hits(tmp_path: pathlib.Path) -> None:
    async with await _device_only_prefix(tmp_path) as h:
        op = start_prefetch(h, "r", SEQ)
        h.tree.evict(10**6)
        await until(lambda: op.reads_finished)
        h.tree.prefetcher.may_run("r")
        assert h.controller.metrics.counts["l3_hit_tokens"] == 0


async def test_the_anchor_of_a_running_prefetch_survives_host_eviction() -> None:
    h, gate = await gated()
    try:
        h.run_request("w", SEQ[:8])
        await quiesce(h)
        h.tree.evict(10**6)  # pages 0-1 on host only: the prefetch hangs from that node
        op = start_prefetch(h, "r", SEQ)
        assert op.candidates[0].page_index == 2
        await until(lambda: gate.waiting == 1)
        assert h.tree.host_evictor.evict(10**6) == 0  # the anchor is the only host leaf: kept
        gate.open()
        await until(lambda: op.reads_finished)
        assert h.tree.prefetcher.may_run("r") is True
        await assert_clean(h)
        assert h.run_request("r", SEQ) == {"device": 0, "host": 32, "computed": 0}
        h.tree.evict(10**6)
        assert h.tree.host_evictor.evict(10**6) == 32  # once taken, nothing holds the anchor
    finally:
        gate.open()
        await h.close()


@pytest.mark.parametrize("pool_preset", [PoolPreset.DENSE, PoolPreset.MLA, PoolPreset.DSA])
async def test_every_pool_of_the_group_is_prefetched_exactly(pool_preset: PoolPreset) -> None:
    async with await Harness.build(
        backend=MemoryBackend(), prefetch=WAIT, pool_preset=pool_preset
    ) as h:
        await seed_l3(h, SEQ)
        await _prefetch_all_of_seq(h)


async def test_closing_with_reads_and_writes_in_flight_does_not_hang() -> None:
    reads, writes = Gate(opened=True), Gate(opened=True)
    backend = GatedBackend(MemoryBackend(), get=reads, put=writes)
    h = await Harness.build(backend=backend, prefetch=WAIT)
    await seed_l3(h, SEQ)
    reads.shut()
    writes.shut()
    op = start_prefetch(h, "r", SEQ)
    h.run_request("w", tokens(500, 2))
    await until(lambda: reads.waiting == 1 and writes.waiting == 1)
    await asyncio.wait_for(h.close(), timeout=5.0)
    assert backend.closed and op.reads_finished
    assert h.controller.storage.prefetches_running == 0 and not h.controller.storage.enabled


WRITE_PATHS = {
    # write_back: L3 sees a page once the device evicts it to host
    "write_back": (TierConfig(write_policy=WritePolicy.WRITE_BACK), StorageConfig(), [0, 0, 0]),
    # backed up on the first hit, admitted to L3 on the second
    "selective_hit_threshold": (
        TierConfig(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold=1),
        StorageConfig(admission=L3Admission.HIT_THRESHOLD, admission_hit_threshold=2),
        [0, 0, 8],
    ),
}


@pytest.mark.parametrize("path", sorted(WRITE_PATHS))
async def test_each_write_path_reaches_l3_and_reads_back_exactly(path: str) -> None:
    tiers, storage, written = WRITE_PATHS[path]
    async with await Harness.build(
        backend=MemoryBackend(), tiers=tiers, storage=storage, prefetch=WAIT
    ) as h:
        seen = []
        for i in range(3):
            h.run_request(f"a{i}", [*SEQ, 99 + i])
            await quiesce(h)
            seen.append(h.controller.metrics.counts["pages_written_l3"])
        assert seen == written
        h.tree.evict(10**6)
        await quiesce(h)
        assert h.controller.metrics.counts["pages_written_l3"] == 8
        h.tree.host_evictor.evict(10**6)
        assert not h.tree.all_nodes()
        await _prefetch_all_of_seq(h)
