"""Block copies between vLLM's KV cache and its host offload region, on the CPU.

vLLM's own offloading worker copies with CUDA streams and refuses to start on a CPU engine. This
module does the same copies with torch on the CPU: which bytes of which KV block go to which
host chunk. It mirrors the layout vLLM's CPU offloading worker uses (its "direct" layout):

- each KV tensor is viewed as ``(num_blocks, page_bytes)`` int8 rows, one row per vLLM block;
- each host tensor is ``(num_chunks, blocks_per_chunk * page_bytes)``: a chunk row holds
  ``blocks_per_chunk`` consecutive blocks of one request, in order;
- a job names the blocks per KV cache group (``group_sizes``) and, per group, the logical index
  of its first block (``block_indices``), so a chunk that is only partly covered (the first one
  of a group that starts mid-chunk) is entered at the right block.

No vLLM import here: the worker (:mod:`.host_worker`) hands in tensors and plain arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache.errors import InvalidArgumentError

__all__ = ["BlockCopier", "TensorPair", "contiguous_runs", "sub_block_positions"]


@dataclass(frozen=True)
class TensorPair:
    """One KV tensor and its host twin, and how many bytes of each block row are data."""

    device: torch.Tensor  # (num_blocks, page_bytes) int8, possibly strided
    host: torch.Tensor  # (num_chunks, blocks_per_chunk * page_bytes) int8, row-strided
    data_bytes: int  # the un-padded page size: bytes past it in a row are padding


def sub_block_positions(
    chunk_ids: np.ndarray, blocks_per_chunk: int, count: int, skip: int
) -> tuple[np.ndarray, np.ndarray]:
    """The (chunk, block-within-chunk) pairs of ``count`` consecutive blocks that start at
    block ``skip`` of the first chunk in ``chunk_ids``."""
    chunks = np.repeat(chunk_ids.astype(np.int64), blocks_per_chunk)
    within = np.tile(np.arange(blocks_per_chunk, dtype=np.int64), len(chunk_ids))
    end = skip + count
    if end > len(chunks):
        raise InvalidArgumentError(
            f"{count} blocks from block {skip} do not fit in {len(chunk_ids)} chunks"
        )
    return chunks[skip:end], within[skip:end]


class BlockCopier:
    """Copies whole KV blocks between the device tensors and the host chunks."""

    def __init__(
        self,
        pairs: Sequence[TensorPair],
        tensors_per_group: Sequence[Sequence[int]],
        blocks_per_chunk: int,
    ) -> None:
        if blocks_per_chunk < 1:
            raise InvalidArgumentError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        for pair in pairs:
            _check_pair(pair, blocks_per_chunk)
        self._pairs = list(pairs)
        self._groups = [sorted(set(group)) for group in tensors_per_group]
        self._blocks_per_chunk = blocks_per_chunk
        # Each host row seen as (chunk, block within it, page bytes): a view, no copy.
        self._host_blocks = [
            pair.host.view(pair.host.shape[0], blocks_per_chunk, pair.device.shape[1])
            for pair in pairs
        ]

    def copy(
        self,
        block_ids: np.ndarray,
        chunk_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        to_host: bool,
    ) -> int:
        """Copy a job's blocks (``to_host``: device -> host, else host -> device); the bytes
        moved. ``block_ids`` and ``chunk_ids`` are concatenated group by group."""
        if len(group_sizes) != len(self._groups) or len(block_indices) != len(self._groups):
            raise InvalidArgumentError(
                f"a job for {len(group_sizes)} KV groups, the cache has {len(self._groups)}"
            )
        moved = 0
        block_at = chunk_at = 0
        for group, size, first in zip(self._groups, group_sizes, block_indices, strict=True):
            if size == 0:
                continue
            skip = int(first) % self._blocks_per_chunk
            n_chunks = -(-(size + skip) // self._blocks_per_chunk)
            blocks = block_ids[block_at : block_at + size]
            chunks = chunk_ids[chunk_at : chunk_at + n_chunks]
            if len(blocks) != size or len(chunks) != n_chunks:
                raise InvalidArgumentError("the job's block or chunk ids run short of its groups")
            rows, within = sub_block_positions(chunks, self._blocks_per_chunk, size, skip)
            for t in group:
                moved += self._copy_tensor(t, blocks, rows, within, to_host)
            block_at += size
            chunk_at += n_chunks
        if block_at != len(block_ids) or chunk_at != len(chunk_ids):
            raise InvalidArgumentError("the job names more block or chunk ids than its groups")
        return moved

    def _copy_tensor(
        self,
        t: int,
        blocks: np.ndarray,
        rows: np.ndarray,
        within: np.ndarray,
        to_host: bool,
    ) -> int:
        data = self._pairs[t].data_bytes
        device = self._pairs[t].device
        host = self._pairs[t].host if self._blocks_per_chunk == 1 else None
        host_blocks = self._host_blocks[t]
        for start, end in contiguous_runs(blocks, rows, within, self._blocks_per_chunk):
            kv = device[int(blocks[start]) : int(blocks[start]) + end - start, :data]
            if host is not None:  # one block a chunk: a run of consecutive chunk rows
                stored = host[int(rows[start]) : int(rows[start]) + end - start, :data]
            else:  # a run of consecutive blocks inside one chunk row
                first = int(within[start])
                stored = host_blocks[int(rows[start]), first : first + end - start, :data]
            if to_host:
                stored.copy_(kv)
            else:
                kv.copy_(stored)
        return len(blocks) * data


def contiguous_runs(
    blocks: np.ndarray, rows: np.ndarray, within: np.ndarray, blocks_per_chunk: int
) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of the job's blocks that are consecutive on both sides, so each
    moves in one strided copy: block ids one apart, and host positions one apart (the next
    chunk row when a chunk holds one block, else the next block of the same chunk row).

    torch's index ops move wide int8 rows several times slower than a copy of a slice (about
    8x for 48 KiB rows here), so a job is cut into as few slices as its ids allow; a fresh
    engine allocates blocks and host chunks mostly in runs.
    """
    if len(blocks) == 0:
        return []
    block_next = np.diff(blocks.astype(np.int64)) == 1
    if blocks_per_chunk == 1:
        host_next = np.diff(rows) == 1
    else:
        host_next = (np.diff(rows) == 0) & (np.diff(within) == 1)
    breaks = np.flatnonzero(~(block_next & host_next)) + 1
    edges = [0, *breaks.tolist(), len(blocks)]
    return list(itertools.pairwise(edges))


def _check_pair(pair: TensorPair, blocks_per_chunk: int) -> None:
    device, host = pair.device, pair.host
    if device.dtype != torch.int8 or host.dtype != torch.int8:
        raise InvalidArgumentError("KV and host tensors are viewed as int8 bytes")
    if device.dim() != 2 or host.dim() != 2 or device.stride(1) != 1 or host.stride(1) != 1:
        raise InvalidArgumentError("KV and host tensors are 2-D with contiguous rows")
    if host.shape[1] != device.shape[1] * blocks_per_chunk:
        raise InvalidArgumentError(
            f"a host chunk of {host.shape[1]} bytes does not hold {blocks_per_chunk} "
            f"blocks of {device.shape[1]}"
        )
    if not 0 < pair.data_bytes <= device.shape[1]:
        raise InvalidArgumentError(
            f"{pair.data_bytes} data bytes in a block row of {device.shape[1]}"
        )
