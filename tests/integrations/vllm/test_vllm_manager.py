"""HiCacheTier under vLLM's own TieringOffloadingManager, over a real CPU primary tier (vLLM's
SharedOffloadRegion in /dev/shm): chunks stored from the primary cascade to hicache, leave the
primary (evicted or reset), and come back byte-exact through vLLM's promotion path. Only the
GPU worker's copies are played by the test (vLLM's worker side needs CUDA)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.manager",
    reason="vLLM is installed only in the vLLM venv (make test-vllm)",
)

from closing_kit import closed_on_exit
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm_kit import NUM_CHUNKS, key, make_spec

from hicache.integrations.vllm import HiCacheTier

END = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())


class Engine:
    """vLLM's offloading manager with the test playing the GPU worker's copies."""

    def __init__(self, url: str, **tier_options: Any) -> None:
        self.manager = make_spec(url, **tier_options).get_manager()
        (self.tier,) = self.manager.secondary_tiers
        assert isinstance(self.tier, HiCacheTier)
        view = self.manager.primary_tier.get_kv_memoryview()
        self.primary = np.asarray(view).view(np.uint8)  # zero-copy over the shared region
        self._requests = 0
        # vLLM 0.33's manager has a lock its callers hold; 0.32's has none (one thread).
        self.lock = getattr(self.manager, "lock", contextlib.nullcontext())

    def step(self) -> None:
        """One scheduler step's end: the manager collects the tier's finished jobs."""
        with self.lock:
            self.manager.on_schedule_end(END)

    def offload(self, keys: list[bytes], data: np.ndarray) -> None:
        """One request's chunks written GPU -> primary, then cascaded to the hicache tier."""
        ctx = self._request()
        with self.lock:
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None
            slots = list(out.store_spec.chunk_ids)
            wanted = [keys.index(k) for k in out.keys_to_store]
            self.primary[slots] = data[wanted]  # the worker's GPU -> CPU copy
            self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.tier.drain_jobs()
        self.step()

    def lookups(self, keys: list[bytes], ctx: ReqContext) -> list[LookupResult]:
        with self.lock:
            return [self.manager.lookup(k, ctx) for k in keys]

    def fetch(self, keys: list[bytes], steps: int = 200) -> tuple[np.ndarray, list[list[str]]]:
        """Look the keys up step after step until all hit the primary, then read them as the
        worker's CPU -> GPU copy would; also returns each step's lookup results."""
        ctx = self._request()
        seen: list[list[str]] = []
        for _ in range(steps):
            results = self.lookups(keys, ctx)
            seen.append([r.name for r in results])
            if all(r is LookupResult.HIT for r in results):
                break
            self.step()
            self.tier.drain_jobs()
            time.sleep(0.005)
        with self.lock:
            slots = self.manager.prepare_load(keys, ctx).chunk_ids
            rows = self.primary[slots].copy()
            self.manager.complete_load(keys, ctx)
            self.manager.on_request_finished(ctx)
        return rows, seen

    def reset_primary(self) -> None:
        with self.lock:
            self.manager.reset_cache()
            if hasattr(self.manager, "on_reset_flushed"):  # vLLM 0.33 splits the reset in two
                self.manager.on_reset_flushed()
        self.primary[:] = 0

    def _request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        with self.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def close(self) -> None:
        del self.primary  # vLLM unmaps the region only when no export of it is left
        self.manager.shutdown()


@pytest.fixture(params=["disk", "file"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"{request.param}://{tmp_path / 'store'}"


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    with closed_on_exit(Engine.close) as made:
        yield made


def chunks(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)


def test_reset_primary_then_promote_back(store_url: str, engines: list[Engine]) -> None:
    engine = Engine(store_url)
    engines.append(engine)
    keys = [key(n) for n in (1, 2, 3)]
    data = chunks(3, engine.primary.shape[1], seed=1)
    engine.offload(keys, data)
    engine.reset_primary()
    rows, seen = engine.fetch(keys)
    assert np.array_equal(rows, data)
    # The primary missed, the tier answered (at once: it knew what it had stored), and vLLM
    # promoted the chunks (HIT_PENDING) before they hit in the primary.
    assert seen[0] == ["HIT_PENDING"] * 3 and seen[-1] == ["HIT"] * 3


def test_evicted_from_the_primary_found_in_hicache(store_url: str, engines: list[Engine]) -> None:
    engine = Engine(store_url)
    engines.append(engine)
    width = engine.primary.shape[1]
    first = [key(n) for n in range(10, 10 + NUM_CHUNKS)]
    data = chunks(NUM_CHUNKS, width, seed=2)
    engine.offload(first, data)
    engine.offload([key(n) for n in range(100, 100 + NUM_CHUNKS)], chunks(NUM_CHUNKS, width, 3))
    ctx = ReqContext(req_id="probe")
    with engine.lock:
        engine.manager.on_new_request(ctx)
    assert LookupResult.HIT not in engine.lookups(first[:4], ctx)  # all gone from the primary
    rows, _ = engine.fetch(first[:4])
    assert np.array_equal(rows, data[:4])


def test_a_second_engine_and_a_restart_hit(store_url: str, engines: list[Engine]) -> None:
    first = Engine(store_url)
    engines.append(first)
    keys = [key(n) for n in (7, 8)]
    data = chunks(2, first.primary.shape[1], seed=4)
    first.offload(keys, data)
    first.close()
    engines.remove(first)  # a restart: the next engine opens the store anew
    second = Engine(store_url)
    engines.append(second)
    rows, seen = second.fetch(keys)
    assert np.array_equal(rows, data)
    assert "RETRY" in seen[0]  # it did not know them yet: its background probe found them
