"""Chaos: serving over an L3 that fails, stalls and corrupts at random rates.

Whatever L3 does, the outputs are the no-cache run's token for token, every lock and reserved
page is released once the cache settles, and the counters add up: each page handed to the L3
writer is written, skipped, failed or dropped, and each prefetch ends exactly once.
"""

from __future__ import annotations

import asyncio
import pathlib
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_kit import (
    CHAT,
    DEVICE_TOKENS,
    ENGINE,
    RUN_TIMEOUT_S,
    Recording,
    baseline,
    hicache_config,
    tiny_model,
)

from hicache.backends.wrappers import FaultConfig, FaultInjectionBackend, FaultMode
from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode
from hicache.serving.setup import open_engine
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.policies import PrefetchStopPolicy, TerminationReason, WritePolicy
from hicache.workloads.synthetic import MultiTurnChat

rates = st.floats(min_value=0.0, max_value=0.6)


def assert_settled(cache: HiRadixCache) -> None:
    host = cache.controller.anchor_host
    assert cache.idle and cache.protected_size == 0
    assert [n.id for n in cache.all_nodes() if n.lock_ref] == []
    assert host.protected_pages == 0 and cache.prefetcher.pages_in_use == 0
    on_host = sum(len(n.host_value) for n in cache.all_nodes() if n.host_value is not None)
    assert host.used_pages == on_host, "host pages leaked"


def assert_counters_add_up(counts: dict[str, float]) -> None:
    settled = (
        counts["pages_written_l3"]
        + counts["pages_skipped_l3"]
        + counts["l3_write_failures"]
        + counts["dropped_writes"]
    )
    assert counts["pages_submitted_l3"] == settled
    ended = sum(counts[f"prefetch_{reason.value}"] for reason in TerminationReason)
    assert counts["prefetch_started"] == ended


async def serve_with_faults(l3: pathlib.Path, faults: FaultConfig, write: WritePolicy) -> None:
    config = hicache_config(l3, write, PrefetchStopPolicy.WAIT_COMPLETE)
    # Stalls outlast the deadline, so they end as timeouts: counted, and a miss.
    config = config.with_changes("storage", op_deadline_s=0.05)
    setup = await open_engine(
        tiny_model(ModelPreset.DENSE), CacheMode.DEVICE_HOST_L3, config, DEVICE_TOKENS, ENGINE
    )
    cache = setup.cache
    assert cache is not None and cache.storage.backend is not None
    cache.storage.backend = FaultInjectionBackend(cache.storage.backend, faults)
    recording = Recording(MultiTurnChat(CHAT))
    try:
        records = await asyncio.wait_for(setup.engine.run(recording), RUN_TIMEOUT_S)
        await cache.quiesce(30.0)
        assert_settled(cache)
        assert_counters_add_up(cache.metrics.as_dict())
    finally:
        await setup.close(drain_s=0.0)
    want = await baseline(ModelPreset.DENSE)
    assert not [r.error for r in records if r.error is not None]
    assert recording.outputs == want.outputs  # L3 faults never change what is generated


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fail=rates,
    stall=st.floats(min_value=0.0, max_value=0.3),
    corrupt=rates,
    raising=st.booleans(),
    write=st.sampled_from([WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK]),
    seed=st.integers(0, 2**16),
)
def test_outputs_locks_and_counters_survive_a_faulty_l3(
    fail: float, stall: float, corrupt: float, raising: bool, write: WritePolicy, seed: int
) -> None:
    faults = FaultConfig(
        fail_rate=fail,
        fail_mode=FaultMode.RAISE if raising else FaultMode.RETURN,
        stall_rate=stall,
        stall_seconds=0.1,
        corrupt_rate=corrupt,
        seed=seed,
    )
    with tempfile.TemporaryDirectory() as l3:
        asyncio.run(serve_with_faults(pathlib.Path(l3), faults, write))


def test_a_clean_l3_is_the_control() -> None:
    """The same checks pass with no faults at all, and the L3 is then really used."""
    with tempfile.TemporaryDirectory() as l3:
        asyncio.run(serve_with_faults(pathlib.Path(l3), FaultConfig(), WritePolicy.WRITE_THROUGH))
        assert any(pathlib.Path(l3).rglob("*-*-*"))  # pages were written
