"""The two tiers that ``hicache bench vllm`` drives: each built by vLLM's own
``SecondaryTierFactory`` from a real ``TieringOffloadingSpec``, over a primary view of its own
(an anonymous mmap with the shape vLLM hands a tier: one row of bytes per chunk).

Ours is ``HiCacheTier`` over ``disk://``; theirs vLLM's ``fs`` tier (``FileSystemTierManager``)
with its defaults but for the thread counts, which both sides share. Runs only where vLLM is
installed (the vLLM venv).
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "OURS",
    "THEIRS",
    "Side",
    "TierShape",
    "Transfer",
    "offload_keys",
    "offloading_config",
    "tier_config",
    "tiering_spec",
]

OURS, THEIRS = "hicache", "fs"
_ENGINE_IDS = itertools.count()


@dataclass(frozen=True, slots=True)
class TierShape:
    """What one bench side moves: chunks of ``chunk_bytes``, ``job_chunks`` to a job."""

    chunk_bytes: int
    chunks: int  # chunks per round
    job_chunks: int
    threads: int  # read threads and write threads, each side


@dataclass(frozen=True, slots=True)
class Transfer:
    """One side's jobs of one round, one way: wall and process CPU seconds from the first
    submit until every result was collected, and each submit call's microseconds per chunk."""

    seconds: float
    cpu_seconds: float
    submit_us: list[float]


def tier_config(name: str, root: str, threads: int) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of one side, as a vLLM user writes it."""
    path = os.path.join(root, name)
    common = {"n_read_threads": threads, "n_write_threads": threads}
    if name == OURS:
        url = f"disk://{path}"
        module = "hicache.integrations.vllm"
        return {"type": "HiCacheTier", "module_path": module, "url": url, **common}
    return {"type": "fs", "root_dir": path, **common}


def offloading_config(
    extra_config: dict[str, Any],
    block_bytes: int,
    *,
    engine: str,
    model: str = "bench-model",
    dtype: str = "bfloat16",
    rank: int = 0,
    tp: int = 1,
    events: bool = False,
) -> Any:
    """vLLM's ``OffloadingConfig`` for one layer of ``block_bytes`` blocks, as vLLM's own tier
    tests build it; ``engine`` joins a unique engine id, which names the /dev/shm region."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=f"hicache-{engine}-{os.getpid()}-{next(_ENGINE_IDS)}",
        model=OffloadingModelConfig(name=model, dtype=dtype),  # no max_model_len: 0.32 has none
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank, tp, tp, 1, 1, 1, 0, 1, None, False),
    )


def tiering_spec(
    tier: dict[str, Any], chunk_bytes: int, num_chunks: int, *, engine: str, **config: Any
) -> Any:
    """A real ``TieringOffloadingSpec`` with the one secondary ``tier`` (a ``secondary_tiers``
    entry) over ``num_chunks`` host chunks; ``config`` as :func:`offloading_config` takes it."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * chunk_bytes,
        "secondary_tiers": [tier],
    }
    return TieringOffloadingSpec(offloading_config(extra, chunk_bytes, engine=engine, **config))


def offload_keys(tag: int, count: int) -> list[bytes]:
    """``count`` distinct offload keys (32-byte block hashes, group 0) of batch ``tag``."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key((tag << 32 | i).to_bytes(32, "big"), 0) for i in range(count)]


class Side:
    """One tier and its primary view of ``num_chunks`` rows."""

    def __init__(self, name: str, config: dict[str, Any], chunk_bytes: int, num_chunks: int):
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        self.name = name
        spec = tiering_spec(config, chunk_bytes, num_chunks, engine="bench")
        self._buf = mmap.mmap(-1, num_chunks * chunk_bytes)
        self.primary = np.frombuffer(self._buf, dtype=np.uint8).reshape(num_chunks, chunk_bytes)
        # The view vLLM hands a tier: a row of bytes per chunk (strides[0] is the chunk's size).
        view = memoryview(self._buf).cast("B", [num_chunks, chunk_bytes])
        self.tier = SecondaryTierFactory.create_secondary_tier(dict(config), view, spec)
        self._job_ids = itertools.count()

    def transfer(
        self, keys: Sequence[bytes], first_chunk: int, job_chunks: int, load: bool
    ) -> Transfer:
        """Submit ``keys`` (chunks from ``first_chunk`` on) as jobs of ``job_chunks`` and wait
        for every result. The process's CPU time counts the tier's own threads too (the other
        side's tier is idle meanwhile)."""
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        ctx = ReqContext(req_id=f"bench-{self.name}")
        submit = self.tier.submit_load if load else self.tier.submit_store
        submitting: list[float] = []
        cpu, start = time.process_time(), time.perf_counter()
        for at in range(0, len(keys), job_chunks):
            batch = list(keys[at : at + job_chunks])
            ids = np.arange(first_chunk + at, first_chunk + at + len(batch), dtype=np.int32)
            job = TransferJob(next(self._job_ids), batch, ids, load, ctx)
            t0 = time.perf_counter()
            submit(job)
            submitting.append((time.perf_counter() - t0) / len(batch) * 1e6)
        self.tier.drain_jobs()
        results = list(self.tier.get_finished_jobs())
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        failed = [r.job_id for r in results if not r.success]
        if failed or len(results) != -(-len(keys) // job_chunks):
            kind = "load" if load else "store"
            raise RuntimeError(f"{self.name}: {kind} jobs failed or missing: {failed}")
        return Transfer(elapsed, cpu, submitting)

    def close(self) -> None:
        self.tier.shutdown()  # the mmap goes with the last view of it (a tier may keep one)
