"""HiCacheTier's lifecycle: batched probes, KV events, metrics labels, timeouts that never cut a
load short, and a shutdown that reports every job. Runs in the vLLM venv."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base",
    reason="vLLM is installed only in the vLLM venv (make test-vllm)",
)

from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm_kit import CHUNK, CTX, Primary, done, fill, job, key, settle, store

from hicache.integrations.vllm import HiCacheTier
from hicache.integrations.vllm import tier as tier_module


class Gated:
    """A backend whose reads and writes wait for a gate (a slow or hung store), counting the
    existence checks it answers."""

    def __init__(self, inner: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._inner = inner
        self.gate = asyncio.Event()
        self._loop = loop
        self.exists_calls: list[int] = []
        self.reads_started = threading.Event()

    def open_gate(self) -> None:
        self._loop.call_soon_threadsafe(self.gate.set)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self.exists_calls.append(len(keys))
        return await self._inner.exists(keys)

    async def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        self.reads_started.set()
        await self.gate.wait()
        return await self._inner.get_into(keys, buffers)

    async def put_missing(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        await self.gate.wait()
        return await self._inner.put_missing(keys, values)


def gated(tier: HiCacheTier, start_open: bool = True) -> Gated:
    wrapper = Gated(tier._backend, tier._loop._loop)
    if start_open:
        tier._loop.run(_set(wrapper.gate))
    tier._backend = wrapper
    return wrapper


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_lookups_of_a_step_cost_one_exists(
    url: str, make_tier: Callable[..., Primary], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wide gathering window, so that a busy machine cannot split the batch.
    monkeypatch.setattr(tier_module, "_PROBE_GATHER_S", 0.5)
    tier, primary = make_tier(url)
    fill(primary, [0, 1])
    store(tier, primary, [key(1), key(2)])
    other, _ = make_tier(url) if not url.startswith("memory") else (tier, None)
    probe = gated(other)
    keys = [key(n) for n in range(100, 160)] + ([key(1), key(2)] if other is not tier else [])
    assert {other.lookup(k, CTX) for k in keys} == {LookupResult.RETRY}
    results = settle(other, keys)
    assert probe.exists_calls == [len(keys)]  # one batched call for the whole step
    expected_hits = 2 if other is not tier else 0
    assert results.count(LookupResult.HIT) == expected_hits
    assert results.count(LookupResult.MISS) == len(keys) - expected_hits


def test_store_and_removal_events(url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(url, events=True, enable_kv_events=True, locality="LOCAL")
    keys = [key(1), key(2)]
    fill(primary, [0, 1])
    store(tier, primary, keys)
    (event,) = tier.take_events()
    assert (list(event.keys), event.medium, event.removed) == (keys, Medium.STORAGE, False)
    assert event.locality is not None and event.locality.value == "LOCAL"
    assert list(tier.take_events()) == []
    name = tier._names.name(keys[0])
    assert tier._loop.run(tier._backend.delete([name])) == [True]
    tier.submit_load(job(2, keys, [4, 5], load=True))
    (result,) = done(tier)
    assert list(result.successful_keys or []) == [keys[1]]
    (gone,) = tier.take_events()
    assert (list(gone.keys), gone.removed) == ([keys[0]], True)


def test_events_need_vllm_events_on(url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(url, events=False, enable_kv_events=True)
    fill(primary, [0])
    store(tier, primary, [key(1)])
    assert list(tier.take_events()) == []


def test_config_info_labels(make_tier: Callable[..., Primary]) -> None:
    tier, _ = make_tier("memory://", n_read_threads=3)
    labels = HiCacheTier.config_info_keys({})
    assert "tier" not in labels  # vLLM adds its own
    assert dict(tier.config_info()) == {
        "hicache_scheme": "memory",
        "hicache_n_read_threads": 3,
        "hicache_n_write_threads": 8,
    }


def test_a_slow_load_is_never_cut_short(url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(url, io_timeout_s=0.2)
    expected = fill(primary, [0])
    store(tier, primary, [key(1)])
    backend = gated(tier, start_open=False)
    tier.submit_load(job(2, [key(1)], [6], load=True))
    assert backend.reads_started.wait(5)
    time.sleep(0.4)  # twice the timeout: the read is still running, the job still in flight
    assert tier.has_pending_work() and not tier.get_finished_jobs()
    backend.open_gate()
    (result,) = done(tier)
    assert result.success and np.array_equal(primary[6], expected[0])


def test_a_store_past_its_timeout_fails(url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(url, io_timeout_s=0.2)
    fill(primary, [0])
    backend = gated(tier, start_open=False)
    started = time.monotonic()
    tier.submit_store(job(1, [key(1)], [0], load=False))
    (result,) = done(tier)
    assert not result.success and time.monotonic() - started < 5
    backend.open_gate()
    assert settle(tier, [key(1)]) == [LookupResult.MISS]  # never marked stored


def test_a_queued_load_times_out_waiting(url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(url, io_timeout_s=0.3, n_read_threads=1)
    expected = fill(primary, [0, 1])
    store(tier, primary, [key(1), key(2)])
    backend = gated(tier, start_open=False)
    tier.submit_load(job(2, [key(1)], [5], load=True))  # holds the one read slot
    assert backend.reads_started.wait(5)
    tier.submit_load(job(3, [key(2)], [6], load=True))  # waits for it, past the timeout
    deadline = time.monotonic() + 5
    finished: list[Any] = []
    while not finished and time.monotonic() < deadline:
        finished = list(tier.get_finished_jobs())
        time.sleep(0.02)
    assert [(r.job_id, r.success) for r in finished] == [(3, False)]
    assert not primary[6].any()  # the queued load never touched its slot
    backend.open_gate()
    (first,) = done(tier)
    assert first.success and np.array_equal(primary[5], expected[0])


def test_shutdown_reports_jobs_that_cannot_end(make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier("memory://", io_timeout_s=0.3)
    fill(primary, [0, 1])
    store(tier, primary, [key(1)])
    gated(tier, start_open=False)
    tier.submit_load(job(2, [key(1)], [4], load=True))  # hangs: the gate never opens
    tier.submit_store(job(3, [key(2)], [1], load=False))
    started = time.monotonic()
    tier.shutdown()
    assert time.monotonic() - started < 5
    results = sorted((r.job_id, r.success) for r in tier.get_finished_jobs())
    assert results == [(2, False), (3, False)]
    assert not tier.has_pending_work()
    tier.submit_store(job(4, [key(3)], [0], load=False))  # after shutdown: failed, not raised
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(4, False)]


def test_duplicate_keys_in_one_store(url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(url)
    fill(primary, [0, 1])
    tier.submit_store(job(1, [key(1), key(1)], [0, 1], load=False))
    (result,) = done(tier)
    assert result.success and result.transfer_bytes == CHUNK
