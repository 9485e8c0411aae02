"""``HiCacheOffloadingSpec``: vLLM's KV offloading to host memory and on to any hicache store,
on vLLM's CPU platform as on CUDA.

Selected through vLLM's ``OffloadingConnector``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "HiCacheOffloadingSpec",
        "spec_module_path": "hicache.integrations.vllm",
        "cpu_bytes_to_use": 2000000000, "url": "disk:///var/cache/hicache"}}'

It is vLLM's tiering spec with one secondary tier, :class:`~.tier.HiCacheTier` at ``url``:

- the scheduler side is vLLM's own ``TieringOffloadingManager`` over a host tier of
  ``cpu_bytes_to_use`` bytes (a ``/dev/shm`` region the worker processes map too), whose chunks
  cascade to the hicache store and are promoted back from it on a lookup;
- the worker side, which copies between the engine's KV cache and that host region, is vLLM's
  CUDA (or XPU) worker where there is one; on a CPU engine, where vLLM refuses to build it,
  :class:`~.host_worker.HostCopyWorker` does the copies on a thread of its own.

A restarted engine finds what the store holds: vLLM's block hashes (sha256 by default) do not
change across processes, and the store's names cover the model, dtype, chunking, KV layout,
device kind and parallel layout, so a store written by another configuration is a miss.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingMetricMetadata, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.vllm.block_copy import BlockCopier
from hicache.integrations.vllm.host_worker import HostCopyWorker, tensor_pairs
from hicache.integrations.vllm.spec_options import tiering_extra_config

__all__ = ["HiCacheOffloadingSpec"]

log = logging.getLogger("hicache.integrations.vllm")


def _has_device_worker() -> bool:
    """Whether vLLM's own offloading worker runs on this platform."""
    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())


class HiCacheOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]  # vLLM is untyped
    """vLLM's tiering spec with hicache's tier at ``url``, and a worker for CPU engines."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        definitions: dict[str, OffloadingMetricMetadata]
        definitions = super().build_metric_definitions(tiering_extra_config(extra_config))
        return definitions

    def __init__(self, config: OffloadingConfig) -> None:
        extra = tiering_extra_config(config.extra_config)
        if extra.get("canonical_layout") and not _has_device_worker():
            raise ValueError(
                "HiCacheOffloadingSpec option 'canonical_layout' needs vLLM's CUDA or XPU "
                "worker; a CPU engine stores its blocks as they are"
            )
        super().__init__(dataclasses.replace(config, extra_config=extra))
        self._host_worker: HostCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """vLLM's own worker on CUDA and XPU; the host copy worker everywhere else."""
        if _has_device_worker():
            return super().get_worker(kv_caches)
        if self._host_worker is None:
            self._host_worker = self._new_host_worker(kv_caches)
        return self._host_worker

    def _new_host_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        """The worker's view of the host region the scheduler's manager maps (its rank's
        slots), as vLLM's tiering spec makes it for its own worker."""
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            pairs, groups = tensor_pairs(
                kv_caches, region.create_next_worker_view, self.blocks_per_chunk
            )
            copier = BlockCopier(pairs, groups, self.blocks_per_chunk)
        except BaseException:
            region.cleanup()
            raise
        log.info(
            "hicache vLLM spec: host copy worker over %d KV tensors, %d host chunks",
            len(pairs),
            self.num_chunks,
        )
        return HostCopyWorker(copier, region.cleanup)
