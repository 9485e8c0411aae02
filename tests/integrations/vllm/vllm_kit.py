"""Helpers for the vLLM tier tests: offloading specs as vLLM's tier tests build them, tiers
made by vLLM's own factory, and jobs. Imported only after vLLM is known to be there."""

from __future__ import annotations

import mmap
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from hicache.integrations.vllm import HiCacheTier
from hicache.tools.bench.engines.vllm_sides import tiering_spec

CHUNK = 4096
NUM_CHUNKS = 8
CTX = ReqContext(req_id="r1")
Primary = tuple[HiCacheTier, np.ndarray]


def make_spec(
    url: str,
    *,
    rank: int = 0,
    tp: int = 1,
    dtype: str = "float16",
    model: str = "test-model",
    events: bool = False,
    **tier_options: Any,
) -> Any:
    """A real TieringOffloadingSpec with one HiCacheTier at ``url`` (``tier_options`` join its
    dict), as vLLM's tier tests build one; a unique engine id names its /dev/shm region."""
    tier_config = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm", "url": url}
    tier_config.update(tier_options)
    return tiering_spec(
        tier_config,
        CHUNK,
        NUM_CHUNKS,
        engine="test",
        model=model,
        dtype=dtype,
        rank=rank,
        tp=tp,
        events=events,
    )


def build_tier(url: str, **spec_kw: Any) -> Primary:
    """A tier made by vLLM's SecondaryTierFactory over a primary view of our own."""
    spec = make_spec(url, **spec_kw)
    buf = mmap.mmap(-1, NUM_CHUNKS * CHUNK)
    primary = np.frombuffer(buf, dtype=np.uint8).reshape(NUM_CHUNKS, CHUNK)
    (tier_config,) = spec.extra_config["secondary_tiers"]
    tier = SecondaryTierFactory.create_secondary_tier(dict(tier_config), memoryview(primary), spec)
    assert isinstance(tier, HiCacheTier)
    return tier, primary


def key(n: int) -> bytes:
    return make_offload_key(n.to_bytes(32, "big"), 0)


def job(job_id: int, keys: list[bytes], chunks: list[int], load: bool) -> TransferJob:
    ids = np.array(chunks, dtype=np.int32)
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=ids, is_promotion=load, req_context=CTX)


def done(tier: HiCacheTier) -> list[JobResult]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def fill(primary: np.ndarray, chunks: list[int], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    primary[chunks] = rng.integers(0, 256, (len(chunks), CHUNK), dtype=np.uint8)
    return primary[chunks].copy()


def store(tier: HiCacheTier, primary: np.ndarray, keys: list[bytes], job_id: int = 1) -> None:
    tier.submit_store(job(job_id, keys, list(range(len(keys))), load=False))
    (result,) = done(tier)
    assert result.success and result.transfer_bytes == len(keys) * CHUNK


def settle(tier: HiCacheTier, keys: list[bytes], timeout_s: float = 5.0) -> list[LookupResult]:
    """Look up until no key says RETRY (the background probes have answered)."""
    deadline = time.monotonic() + timeout_s
    while True:
        results = [tier.lookup(k, CTX) for k in keys]
        if LookupResult.RETRY not in results or time.monotonic() > deadline:
            return results
        time.sleep(0.01)
