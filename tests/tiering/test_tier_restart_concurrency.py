"""L3 across restarts and models, concurrent requests over small pools, aborts, and metrics."""

from __future__ import annotations

import asyncio
import pathlib
import random

import pytest
from clock_kit import FakeClock
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
from tier_kit import CLOCK_START, PAGE, Harness

from hicache.backends.memory import MemoryBackend
from hicache.dtypes import DType
from hicache.keys import RadixKey
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.pools.req_to_token import ReqToTokenPool
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig, TierConfig
from hicache.tiering.common.metrics import COUNTERS
from hicache.tiering.common.policies import PrefetchStopPolicy, TerminationReason
from hicache.tiering.controller import HiCacheController

WAIT = PrefetchStopPolicy.WAIT_COMPLETE
SEQ = tokens(1, 8)


def waiting(**storage: object) -> dict[str, object]:
    prefetch = PrefetchConfig(stop_policy=WAIT, threshold_tokens=PAGE)
    return {"prefetch": prefetch, "storage": StorageConfig(**storage)}  # type: ignore[arg-type]


async def fetch(h: Harness, rid: str, seq: list[int]) -> int:
    """Prefetch ``seq`` to its end; the pages that arrived."""
    op = start_prefetch(h, rid, seq)
    await until(lambda: op.reads_finished)
    assert h.tree.prefetcher.may_run(rid) is True
    return op.completed_pages


# ----- restart ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [{}, {"compress": True}, {"backend_in_thread": True}],
    ids=["plain", "compressed", "in_thread"],
)
async def test_a_restart_finds_what_was_written_before(
    tmp_path: pathlib.Path, options: dict[str, bool]
) -> None:
    url = f"file://{tmp_path}/l3"
    async with await Harness.build(url=url, **waiting(**options)) as first:
        first.run_request("a", SEQ[:8])  # node boundaries differ from the reader's: [0:8] ...
        first.run_request("b", SEQ)  # ... then [8:32]; the page hashes must not care
        await quiesce(first)
        assert first.controller.metrics.counts["pages_written_l3"] == 8
    async with await Harness.build(url=url, **waiting(**options)) as second:
        assert await fetch(second, "r", SEQ) == 8
        assert second.run_request("r", SEQ) == {"device": 0, "host": 32, "computed": 0}
        # a request sharing only the first 4 pages hits exactly those
        other = SEQ[:16] + tokens(9000, 4)
        assert await fetch(second, "s", other) == 0  # pages 0-3 are cached now: not asked
        second.tree.evict(10**6)
        second.tree.host_evictor.evict(10**6)
        assert await fetch(second, "t", other) == 4
        assert second.run_request("t", other) == {"device": 0, "host": 16, "computed": 16}
        await assert_clean(second)


async def build_shape(
    url: str, shape: ModelShape, pool_preset: PoolPreset = PoolPreset.DENSE, model_id: str = ""
) -> Harness:
    """A harness over pools of ``shape`` (Harness.build fixes the shape)."""
    model = preset(pool_preset, shape)
    owner = next(s.name for s in model if s.shares_slots_with is None)
    device = device_pools(model, {owner: 128}, "cpu")
    host = host_pools(model, {owner: 64})
    storage = StorageConfig(url=url, model_id=model_id or StorageConfig().model_id)
    prefetch = PrefetchConfig(stop_policy=WAIT, threshold_tokens=shape.page_size)
    config = HiCacheConfig(TierConfig(), prefetch, storage)
    controller = await HiCacheController.open(config, device, host)
    clock = FakeClock(CLOCK_START)
    cache = RadixCacheConfig(page_size=shape.page_size)
    tree = HiRadixCache(controller, cache, ReqToTokenPool(16, 128), clock)
    return Harness(controller, tree, device, host, clock)


OTHERS = {
    "model_id": (ModelShape(page_size=PAGE), PoolPreset.DENSE, "another-model"),
    "dtype": (ModelShape(page_size=PAGE, dtype=DType.FLOAT16), PoolPreset.DENSE, ""),
    "mla": (ModelShape(page_size=PAGE), PoolPreset.MLA, ""),
    "heads": (ModelShape(page_size=PAGE, heads=4), PoolPreset.DENSE, ""),
    "page_size": (ModelShape(page_size=8), PoolPreset.DENSE, ""),
}


@pytest.mark.parametrize("what", sorted(OTHERS))
async def test_pages_of_another_model_or_format_are_never_loaded(
    tmp_path: pathlib.Path, what: str
) -> None:
    url = f"file://{tmp_path}/l3"
    async with await Harness.build(url=url, **waiting()) as writer:
        writer.run_request("a", SEQ)
        await quiesce(writer)
    shape, pool_preset, model_id = OTHERS[what]
    async with await build_shape(url, shape, pool_preset, model_id) as reader:
        assert await fetch(reader, "r", SEQ) == 0
        counts = reader.controller.metrics.counts
        assert counts["l3_hit_tokens"] == 0 and counts["bytes_l3_to_host"] == 0
        assert reader.host[reader.controller.anchor].used_pages == 0
        if shape.page_size == PAGE:
            assert reader.run_request("r", SEQ)["computed"] == 32
    # The pages are there for their model.
    async with await Harness.build(url=url, **waiting()) as control:
        assert await fetch(control, "r", SEQ) == 8


# ----- concurrency --------------------------------------------------------------------------------
def workload(seed: int, n: int) -> list[list[int]]:
    """``n`` requests over three shared system prompts with short tails, then each again."""
    rng = random.Random(seed)
    systems = [tokens(1 + 1000 * s, 2) for s in range(3)]
    out = []
    for i in range(n):
        tail_pages = rng.randint(1, 3)
        tail = [50_000 + i * 16 + t for t in range(tail_pages * PAGE)]
        if rng.random() < 0.3:
            tail = tokens(1 + 1000 * rng.randrange(3) + 8, tail_pages)  # a shared continuation
        out.append(systems[rng.randrange(3)] + tail + [7])  # a partial last page
    again = out[:]
    rng.shuffle(again)
    return out + again


async def client(h: Harness, name: str, requests: list[list[int]], done: list[str]) -> None:
    for i, seq in enumerate(requests):
        rid = f"{name}-{i}"
        key = RadixKey(seq)
        h.tree.prefetcher.start(rid, key, h.tree.match_prefix(key))
        while not h.tree.prefetcher.may_run(rid):
            h.tree.check_events()
            await asyncio.sleep(0)
        h.run_request(rid, seq)  # checks every reused slot's KV
        done.append(rid)
        await asyncio.sleep(0)


async def churn(h: Harness, reads: Gate, stop: asyncio.Event) -> None:
    """Eviction, L3 reads and time, a step at a time, while the clients run.

    Everything yields with ``sleep(0)`` and L3 reads pass one every third step, so the
    interleaving is the same on every run however loaded the machine is.
    """
    step = 0
    while not stop.is_set():
        step += 1
        h.tree.evict(16)
        h.tree.host_evictor.evict(8)
        h.clock.advance(0.05)  # a prefetch still reading after 10 steps times out
        if reads.waiting and step % 3 == 0:  # no passes banked for later reads
            reads.release()
        h.tree.check_events()
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("policy", "stopped"),
    [
        (PrefetchStopPolicy.TIMEOUT, "prefetch_timeout"),
        (PrefetchStopPolicy.BEST_EFFORT, "prefetch_best_effort"),
        (PrefetchStopPolicy.WAIT_COMPLETE, "prefetch_complete"),
    ],
)
async def test_concurrent_requests_with_prefetch_and_eviction_stay_exact(
    policy: PrefetchStopPolicy, stopped: str
) -> None:
    reads = Gate()
    prefetch = PrefetchConfig(
        stop_policy=policy, threshold_tokens=PAGE, timeout_base_s=0.5, batch_pages=1
    )
    h = await Harness.build(
        backend=GatedBackend(MemoryBackend(), get=reads),
        prefetch=prefetch,
        # The churn passes prefetch reads one at a time; the writer's read-backs of pages L3
        # holds (check_present) would take those passes too and change the interleaving.
        storage=StorageConfig(check_present=False),
        device_tokens=64,
        host_pages=24,
    )
    try:
        requests = workload(7, 40)
        stop, done = asyncio.Event(), []
        churner = asyncio.create_task(churn(h, reads, stop))
        await asyncio.gather(*(client(h, f"c{c}", requests[c::6], done) for c in range(6)))
        stop.set()
        await churner
        reads.open()
        assert len(done) == 80
        await assert_clean(h)
        counts = h.controller.metrics.counts
        exercised = ["host_hit_tokens", "device_hit_tokens", stopped,
                     "host_evicted_tokens", "device_evicted_tokens"]  # fmt: skip
        if policy is not PrefetchStopPolicy.BEST_EFFORT:  # which never waits for a read
            exercised.append("l3_hit_tokens")
        for name in exercised:
            assert counts[name] > 0, f"the workload never exercised {name}"
        # afterwards every prefix still reads back exactly from wherever it now lives
        for i, seq in enumerate(requests[:6]):
            h.run_request(f"again{i}", seq)
        await assert_clean(h)
    finally:
        reads.open()
        await h.close()


# ----- aborts -------------------------------------------------------------------------------------
def running_request(h: Harness, rid: str, seq: list[int]) -> CachedRequest:
    """A request that matched, locked its prefix and allocated the rest, as a scheduler does."""
    match = h.tree.match_prefix(RadixKey(seq))
    prefix, last = match.device_indices, match.last_device_node
    h.tree.inc_lock_ref(last)
    need = -(-(len(seq) - len(prefix)) // PAGE) * PAGE
    slots = h.kv.alloc(need)
    assert slots is not None
    row = h.tree.req_to_token.alloc()
    h.tree.req_to_token.table[row, : len(prefix)] = prefix
    h.tree.req_to_token.table[row, len(prefix) : len(prefix) + need] = slots
    return CachedRequest(
        rid, seq, row, allocated=len(prefix) + need, prefix_indices=prefix, last_node=last
    )


async def test_an_aborted_request_releases_its_lock_slots_and_prefetch() -> None:
    gate = Gate(opened=True)
    prefetch = PrefetchConfig(stop_policy=WAIT, threshold_tokens=PAGE, batch_pages=2)
    # The gate stops prefetch reads; the writer's read-back of "warm"'s pages (check_present)
    # would wait at it too.
    storage = StorageConfig(check_present=False)
    backend = GatedBackend(MemoryBackend(), get=gate)
    h = await Harness.build(backend=backend, prefetch=prefetch, storage=storage)
    try:
        await seed_l3(h, SEQ)
        gate.shut()
        h.run_request("warm", SEQ[:8])  # two pages on the device again
        await quiesce(h)
        device_before = h.kv.used_size
        op = start_prefetch(h, "r", SEQ)  # pages 2-7 from L3
        req = running_request(h, "r", SEQ)
        assert h.usage()["locked_nodes"] and h.kv.used_size == device_before + 24
        await until(lambda: gate.waiting == 1)
        gate.release()  # one batch (2 pages) arrives, the next waits
        await until(lambda: op.completed_pages == 2 and gate.waiting == 1)
        h.tree.release_request(req)
        assert op.reason is TerminationReason.ABORTED and op.taken_pages == 2
        assert h.controller.metrics.counts["prefetch_aborted"] == 1
        assert h.kv.used_size == device_before and not h.usage()["locked_nodes"]
        assert h.tree.req_to_token.available_size == 16
        assert h.tree.prefetcher.pages_in_use == 4  # still being read: freed once the reads end
        assert h.tree.prefetcher.may_run("r") is True
        gate.open()
        await assert_clean(h)
        # what arrived before the abort was kept, and is exact
        assert h.run_request("again", SEQ) == {"device": 8, "host": 8, "computed": 16}
    finally:
        gate.open()
        await h.close()


async def test_terminate_before_l3_answered_takes_nothing() -> None:
    exists = Gate()
    h = await Harness.build(backend=GatedBackend(MemoryBackend(), exists=exists), **waiting())
    try:
        exists.open()
        await seed_l3(h, SEQ)
        exists.shut()
        op = start_prefetch(h, "r", SEQ)
        await until(lambda: exists.waiting == 1)
        h.tree.prefetcher.terminate("r")
        assert op.taken_pages == 0 and op.reason is TerminationReason.ABORTED
        h.tree.prefetcher.terminate("r")  # a second call changes nothing
        assert h.controller.metrics.counts["prefetch_aborted"] == 1
        exists.open()
        await assert_clean(h)
        assert op.host_pages == [] and h.host["kv"].used_pages == 0
    finally:
        exists.open()
        await h.close()


# ----- metrics ------------------------------------------------------------------------------------
async def test_metrics_as_dict_and_prometheus() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    async with await Harness.build(backend=MemoryBackend(), **waiting()) as h:
        await seed_l3(h, SEQ)
        assert await fetch(h, "r", SEQ) == 8
        stats = h.controller.stats()
        assert set(COUNTERS) <= set(stats)
        assert {"l3_enabled", "l3_write_queue_pages"} <= set(stats)
        assert stats["l3_hit_tokens"] == 32.0 and stats["pages_written_l3"] == 8.0
        assert stats["prefetch_complete"] == 1.0 and stats["l3_enabled"] == 1.0
        for reason in TerminationReason:
            assert f"prefetch_{reason.value}" in stats
        registry = prometheus_client.CollectorRegistry()
        h.controller.metrics.register_prometheus(registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert "hicache_l3_hit_tokens_total 32.0" in text
        assert "hicache_pages_written_l3_total 8.0" in text
        assert "hicache_l3_enabled 1.0" in text
        h.controller.metrics.add("errors", 2)  # read at scrape time, not copied at register time
        assert registry.get_sample_value("hicache_errors_total") == 2.0


def test_an_unknown_counter_is_refused() -> None:
    from hicache.tiering.common.metrics import HiCacheMetrics

    with pytest.raises(KeyError, match="unknown counter"):
        HiCacheMetrics().add("no_such_counter")
