"""The worker side of :class:`~hicache.integrations.vllm.spec.HiCacheOffloadingSpec` on a CPU
engine: copies between vLLM's KV cache and the host offload region, off the model's thread.

vLLM's ``OffloadingConnector`` submits one store or load job per call and collects finished
jobs each step through :meth:`HostCopyWorker.get_finished`. Here each job is one batched
:meth:`~hicache.integrations.vllm.block_copy.BlockCopier.copy` run by a single copy thread, in
submission order (as vLLM's CUDA worker orders its streams), so a load queued behind a store
of the same chunks sees the stored bytes. The copy thread is a pool of one whose every job's
outcome (or exception) comes back through its future: nothing it does is lost unseen.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from hicache.integrations.vllm.block_copy import BlockCopier, TensorPair

__all__ = ["HostCopyWorker", "tensor_pairs"]

log = logging.getLogger("hicache.integrations.vllm")


def tensor_pairs(
    kv_caches: CanonicalKVCaches, new_host_view: Callable[[int], Any], blocks_per_chunk: int
) -> tuple[list[TensorPair], list[list[int]]]:
    """Each KV tensor with a host view of its own (``new_host_view(bytes_per_chunk)``, vLLM's
    ``SharedOffloadRegion.create_next_worker_view``), and the tensors each KV group uses."""
    data_bytes = [0] * len(kv_caches.tensors)
    groups: list[list[int]] = []
    for refs in kv_caches.group_data_refs:
        groups.append([ref.tensor_idx for ref in refs])
        for ref in refs:  # layers sharing a tensor: the widest page of them
            data_bytes[ref.tensor_idx] = max(data_bytes[ref.tensor_idx], ref.page_size_bytes)
    pairs = []
    for index, cache in enumerate(kv_caches.tensors):
        host = new_host_view(cache.page_size_bytes * blocks_per_chunk)
        pairs.append(TensorPair(cache.tensor, host, data_bytes[index]))
    return pairs, groups


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``OffloadingWorker`` for a CPU engine: jobs run in order on one copy thread."""

    def __init__(self, copier: BlockCopier, on_shutdown: Callable[[], None]) -> None:
        self._copier: BlockCopier | None = copier
        self._on_shutdown = on_shutdown
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "hicache-vllm-copy")
        self._jobs: collections.deque[tuple[int, concurrent.futures.Future[TransferResult]]]
        self._jobs = collections.deque()
        self._by_id: dict[int, concurrent.futures.Future[TransferResult]] = {}

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Queue a copy of KV blocks into host chunks."""
        return self._submit(job_id, src_spec, dst_spec.block_ids, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Queue a copy of host chunks into KV blocks."""
        return self._submit(job_id, dst_spec, src_spec.block_ids, to_host=False)

    def _submit(
        self, job_id: int, kv: GPULoadStoreSpec, chunk_ids: np.ndarray, to_host: bool
    ) -> bool:
        """Queue one job: ``kv`` names the KV blocks and how they split into groups."""
        future = self._pool.submit(
            self._run,
            job_id,
            np.asarray(kv.block_ids),
            np.asarray(chunk_ids),
            (list(kv.group_sizes), list(kv.block_indices)),
            to_host,
        )
        self._jobs.append((job_id, future))
        self._by_id[job_id] = future
        return True

    def _run(
        self,
        job_id: int,
        block_ids: np.ndarray,
        chunk_ids: np.ndarray,
        groups: tuple[list[int], list[int]],
        to_host: bool,
    ) -> TransferResult:
        start = time.perf_counter()
        if self._copier is None:
            raise RuntimeError("the host copy worker is shut down")
        moved = self._copier.copy(block_ids, chunk_ids, groups[0], groups[1], to_host)
        return TransferResult(
            job_id=job_id,
            success=True,
            transfer_size=moved,
            transfer_time=time.perf_counter() - start,
        )

    def get_finished(self) -> list[TransferResult]:
        """The jobs that ended since the last call, in submission order."""
        done: list[TransferResult] = []
        while self._jobs and self._jobs[0][1].done():
            job_id, future = self._jobs.popleft()
            del self._by_id[job_id]
            done.append(_result(job_id, future))
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until each of ``job_ids`` still queued or running has ended."""
        futures = [self._by_id[j] for j in job_ids if j in self._by_id]
        concurrent.futures.wait(futures)

    def shutdown(self) -> None:
        """Finish the queued copies, then release the host region (the copier's views of it
        go first, so the region's memory map can close)."""
        self._pool.shutdown(wait=True)
        self._jobs.clear()
        self._by_id.clear()
        if self._copier is not None:
            self._copier = None
            self._on_shutdown()


def _result(job_id: int, future: concurrent.futures.Future[TransferResult]) -> TransferResult:
    error = future.exception()
    if error is None:
        return future.result()
    # A copy between two buffers of the same process fails only on a bug: say so loudly.
    log.error("hicache vLLM host copy: job %d failed: %r", job_id, error)
    return TransferResult(job_id=job_id, success=False)
