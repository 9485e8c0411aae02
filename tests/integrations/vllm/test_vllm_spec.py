"""HiCacheOffloadingSpec in-process, on vLLM 0.33 (``make test-vllm``) and on vLLM's CPU build
0.32 (``make test-vllm-serve``): it builds vLLM's tiering manager with the hicache tier, and on
a CPU engine its own worker, whose copies land in the very host region the manager's tier reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed only in its venvs")

import torch
from cuda_kit import needs_cuda
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from hicache.integrations.vllm import HiCacheOffloadingSpec, HiCacheTier
from hicache.integrations.vllm.host_worker import HostCopyWorker
from hicache.tools.bench.engines.vllm_sides import offloading_config

cpu_only = pytest.mark.skipif(
    not current_platform.is_cpu(), reason="the host copy worker is the CPU platform's"
)

PAGE = 4096  # bytes of one KV block of the one layer
NUM_BLOCKS = 16
CHUNKS = 8


def make_config(extra: dict[str, Any]) -> OffloadingConfig:
    return offloading_config(extra, PAGE, engine="spec-test", model="test-model")


def extra_config(url: str, **options: Any) -> dict[str, Any]:
    extra = {
        "spec_name": "HiCacheOffloadingSpec",
        "spec_module_path": "hicache.integrations.vllm",
        "cpu_bytes_to_use": CHUNKS * PAGE,
        "url": url,
    }
    return extra | options


def kv_caches() -> tuple[torch.Tensor, CanonicalKVCaches]:
    kv = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8)
    refs = [[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]]
    return kv, CanonicalKVCaches([CanonicalKVCacheTensor(kv, PAGE)], refs)


def finished(worker: HostCopyWorker, job_id: int) -> Any:
    worker.wait({job_id})
    (result,) = worker.get_finished()
    return result


def test_the_spec_runs_vllms_tiering_manager_over_the_hicache_tier(tmp_path: Path) -> None:
    spec = HiCacheOffloadingSpec(make_config(extra_config(f"disk://{tmp_path}", n_read_threads=2)))
    manager = spec.get_manager()
    try:
        assert isinstance(manager, TieringOffloadingManager)
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, HiCacheTier)
        assert tier.config_info()["hicache_n_read_threads"] == 2
    finally:
        manager.shutdown()
    # vLLM asks the class for its metrics with the raw extra config, before any instance.
    metrics = HiCacheOffloadingSpec.build_metric_definitions(extra_config("memory://"))
    assert "vllm:kv_offload_tiering_chunk_hits" in metrics


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Any, HostCopyWorker, torch.Tensor]]:
    """The scheduler side's manager, and the CPU worker over a KV tensor of its own."""
    spec = HiCacheOffloadingSpec(make_config(extra_config(f"disk://{tmp_path}")))
    manager = spec.get_manager()
    kv, caches = kv_caches()
    worker = spec.get_worker(caches)
    try:
        assert isinstance(worker, HostCopyWorker) and spec.get_worker(caches) is worker
        yield manager, worker, kv
    finally:
        worker.shutdown()
        manager.shutdown()


@cpu_only
def test_the_cpu_worker_copies_into_the_region_the_tier_reads(
    engine: tuple[Any, HostCopyWorker, torch.Tensor],
) -> None:
    manager, worker, kv = engine
    original = kv.clone()
    stored = GPULoadStoreSpec([3, 5], group_sizes=[2], block_indices=[0])
    assert worker.submit_store(1, stored, CPULoadStoreSpec([6, 1]))
    result = finished(worker, 1)
    assert result.success and result.transfer_size == 2 * PAGE
    host = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.int8)
    assert np.array_equal(host[6, :PAGE], original[3].numpy())
    assert np.array_equal(host[1, :PAGE], original[5].numpy())
    del host
    kv.zero_()
    loaded = GPULoadStoreSpec([9, 10], group_sizes=[2], block_indices=[0])
    assert worker.submit_load(2, CPULoadStoreSpec([6, 1]), loaded)
    assert finished(worker, 2).success
    assert torch.equal(kv[9], original[3]) and torch.equal(kv[10], original[5])
    assert not kv[:9].any() and not kv[11:].any()


@cpu_only
def test_jobs_end_in_submission_order(engine: tuple[Any, HostCopyWorker, torch.Tensor]) -> None:
    _manager, worker, kv = engine
    for job in range(6):  # each store overwrites chunk 0; the last load reads the last store
        block = GPULoadStoreSpec([job], group_sizes=[1], block_indices=[0])
        worker.submit_store(job, block, CPULoadStoreSpec([0]))
    last = GPULoadStoreSpec([15], group_sizes=[1], block_indices=[0])
    worker.submit_load(6, CPULoadStoreSpec([0]), last)
    worker.wait(set(range(7)))
    assert [r.job_id for r in worker.get_finished()] == list(range(7))
    assert torch.equal(kv[15], kv[5])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"n_raed_threads": 2}, "no option 'n_raed_threads'"),
        ({"url": ""}, "'url' is required"),
        pytest.param({"canonical_layout": True}, "'canonical_layout'", marks=cpu_only),
    ],
)
def test_a_bad_option_stops_the_spec(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        HiCacheOffloadingSpec(make_config(extra_config("memory://") | options))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"n_read_threads": 0}, "'n_read_threads'"),
        ({"url": "nosuchscheme:///x"}, "'url'"),
        ({"url": "disk:///x?capacity=-1"}, "'url'"),
    ],
)
def test_a_bad_tier_value_stops_the_scheduler_side(options: dict[str, Any], named: str) -> None:
    spec = HiCacheOffloadingSpec(make_config(extra_config("memory://") | options))
    with pytest.raises(ValueError, match=named):
        spec.get_manager()


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_the_spec_gives_vllms_own_worker(tmp_path: Path) -> None:
    """Run by tools/gpu_check.sh where vLLM's CUDA build is installed: the spec builds, its
    manager has the hicache tier, and its worker is vLLM's GPU worker (not the host one)."""
    spec = HiCacheOffloadingSpec(make_config(extra_config(f"disk://{tmp_path}")))
    manager = spec.get_manager()
    kv = torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.int8, device="cuda")
    refs = [[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]]
    worker = spec.get_worker(CanonicalKVCaches([CanonicalKVCacheTensor(kv, PAGE)], refs))
    try:
        assert isinstance(manager.secondary_tiers[0], HiCacheTier)
        assert not isinstance(worker, HostCopyWorker)
        assert type(worker).__name__ == "CPUOffloadingWorker"
    finally:
        worker.shutdown()
        manager.shutdown()
