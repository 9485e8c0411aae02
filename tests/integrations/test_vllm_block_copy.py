"""The CPU engine's block copies (no vLLM needed): KV blocks into host chunks and back, for
whole and partly covered chunks, several KV groups, strided views and padded pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.errors import InvalidArgumentError
from hicache.integrations.vllm.block_copy import (
    BlockCopier,
    TensorPair,
    contiguous_runs,
    sub_block_positions,
)

PAGE = 64  # bytes per block row of a KV tensor
BLOCKS = 12
CHUNKS = 6


def kv_tensor(seed: int, stride: int = PAGE) -> torch.Tensor:
    """A (BLOCKS, PAGE) int8 view with rows ``stride`` bytes apart, filled with known bytes."""
    base = torch.randint(
        -128,
        127,
        (BLOCKS * stride,),
        dtype=torch.int8,
        generator=torch.Generator().manual_seed(seed),
    )
    return base.as_strided((BLOCKS, PAGE), (stride, 1))


def host_tensor(blocks_per_chunk: int, row_stride: int, chunks: int = CHUNKS) -> torch.Tensor:
    """A row-strided host view as vLLM's shared region makes one (rows further apart)."""
    base = torch.zeros(chunks * row_stride, dtype=torch.int8)
    return base.as_strided((chunks, PAGE * blocks_per_chunk), (row_stride, 1))


def test_positions_start_inside_the_first_chunk() -> None:
    rows, within = sub_block_positions(np.array([7, 3]), 4, 5, 2)
    assert rows.tolist() == [7, 7, 3, 3, 3]
    assert within.tolist() == [2, 3, 0, 1, 2]
    with pytest.raises(InvalidArgumentError):
        sub_block_positions(np.array([7]), 4, 3, 2)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_store_then_load_returns_each_block(blocks_per_chunk: int) -> None:
    device = kv_tensor(0, stride=PAGE + 16)  # strided like a layer's view of a packed cache
    original = device.clone()
    host = host_tensor(blocks_per_chunk, PAGE * blocks_per_chunk * 2 + 64)
    copier = BlockCopier([TensorPair(device, host, PAGE)], [[0]], blocks_per_chunk)
    blocks = np.array([5, 1, 9, 2], dtype=np.int32)
    chunks = np.array([4, 0, 3, 1][: -(-4 // blocks_per_chunk)], dtype=np.int32)
    moved = copier.copy(blocks, chunks, [4], [0], to_host=True)
    assert moved == 4 * PAGE
    host_blocks = host.unflatten(1, (blocks_per_chunk, PAGE))
    for i, block in enumerate(blocks):
        chunk, within = divmod(i, blocks_per_chunk)
        assert torch.equal(host_blocks[chunks[chunk], within], original[block])
    device[:] = 0
    back = np.array([0, 3, 7, 11], dtype=np.int32)
    copier.copy(back, chunks, [4], [0], to_host=False)
    for i, block in enumerate(back):
        assert torch.equal(device[block], original[blocks[i]])
    untouched = [b for b in range(BLOCKS) if b not in back.tolist()]
    assert not device[untouched].any()


def test_a_group_starting_mid_chunk_and_two_groups() -> None:
    first, second = kv_tensor(1), kv_tensor(2)
    hosts = [host_tensor(2, PAGE * 2), host_tensor(2, PAGE * 2)]
    pairs = [TensorPair(first, hosts[0], PAGE), TensorPair(second, hosts[1], PAGE)]
    copier = BlockCopier(pairs, [[0], [1]], blocks_per_chunk=2)
    # Group 0: 3 blocks from logical block 1 (half of chunk 5, then all of chunk 2);
    # group 1: 2 blocks from logical block 0 (chunk 0).
    blocks = np.array([4, 6, 8, 10, 11], dtype=np.int32)
    chunks = np.array([5, 2, 0], dtype=np.int32)
    moved = copier.copy(blocks, chunks, [3, 2], [1, 0], to_host=True)
    assert moved == 5 * PAGE
    h0 = hosts[0].unflatten(1, (2, PAGE))
    h1 = hosts[1].unflatten(1, (2, PAGE))
    assert not h0[5, 0].any()  # skipped: the group starts at its second block
    assert torch.equal(h0[5, 1], first[4])
    assert torch.equal(h0[2, 0], first[6]) and torch.equal(h0[2, 1], first[8])
    assert torch.equal(h1[0, 0], second[10]) and torch.equal(h1[0, 1], second[11])
    assert not hosts[1][5].any() and not hosts[0][0].any()  # each group only its own tensor


def test_padding_past_the_data_is_not_copied() -> None:
    device = kv_tensor(3)
    host = host_tensor(1, PAGE)
    BlockCopier([TensorPair(device, host, 40)], [[0]], 1).copy(
        np.array([2]), np.array([1]), [1], [0], to_host=True
    )
    assert torch.equal(host[1, :40], device[2, :40])
    assert not host[1, 40:].any()


def test_bad_jobs_and_tensors_are_refused() -> None:
    device, host = kv_tensor(4), host_tensor(2, PAGE * 2)
    copier = BlockCopier([TensorPair(device, host, PAGE)], [[0]], 2)
    with pytest.raises(InvalidArgumentError, match="KV groups"):
        copier.copy(np.array([1]), np.array([0]), [1, 1], [0, 0], to_host=True)
    with pytest.raises(InvalidArgumentError, match="run short"):
        copier.copy(np.array([1, 2, 3]), np.array([0]), [3], [0], to_host=True)
    with pytest.raises(InvalidArgumentError, match="more block or chunk"):
        copier.copy(np.array([1, 2]), np.array([0, 1]), [2], [0], to_host=True)
    with pytest.raises(InvalidArgumentError, match="does not hold"):
        BlockCopier([TensorPair(device, host, PAGE)], [[0]], 3)
    with pytest.raises(InvalidArgumentError, match="int8"):
        BlockCopier([TensorPair(device.float(), host, PAGE)], [[0]], 2)
    with pytest.raises(InvalidArgumentError, match="data bytes"):
        BlockCopier([TensorPair(device, host, PAGE + 1)], [[0]], 2)


def test_runs_break_where_either_side_jumps() -> None:
    blocks = np.array([4, 5, 6, 9, 10, 11])
    rows = np.array([0, 1, 2, 3, 7, 8])
    assert contiguous_runs(blocks, rows, np.zeros(6, dtype=np.int64), 1) == [(0, 3), (3, 4), (4, 6)]
    rows2, within2 = sub_block_positions(np.array([3, 4]), 2, 3, 1)  # (3,1) (4,0) (4,1)
    assert contiguous_runs(np.array([7, 8, 9]), rows2[:3], within2[:3], 2) == [(0, 1), (1, 3)]
    assert contiguous_runs(np.array([], dtype=np.int64), rows[:0], rows[:0], 1) == []


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_copies_in_runs_match_a_block_by_block_copy(blocks_per_chunk: int, seed: int) -> None:
    """Ids mixing runs and jumps, as an engine's allocators hand them out, both directions."""
    rng = np.random.default_rng(seed)
    count = 9
    start = int(rng.integers(0, blocks_per_chunk))
    n_chunks = -(-(count + start) // blocks_per_chunk)
    blocks = np.sort(rng.choice(BLOCKS, count, replace=False))  # sorted: runs appear
    # Chunk ids with a run in them too: a rotation of 0..n_chunks-1, placed at an offset.
    chunks = np.roll(np.arange(n_chunks), int(rng.integers(0, n_chunks))) + 2
    device = kv_tensor(seed, stride=PAGE + 32)
    original = device.clone()
    host = host_tensor(blocks_per_chunk, PAGE * blocks_per_chunk + 128, chunks=n_chunks + 2)
    copier = BlockCopier([TensorPair(device, host, PAGE)], [[0]], blocks_per_chunk)
    copier.copy(blocks, chunks, [count], [start], to_host=True)
    rows, within = sub_block_positions(chunks, blocks_per_chunk, count, start)
    host_blocks = host.view(n_chunks + 2, blocks_per_chunk, PAGE)
    for block, row, w in zip(blocks, rows, within, strict=True):
        assert torch.equal(host_blocks[row, w], original[block])
    device.zero_()
    copier.copy(blocks, chunks, [count], [start], to_host=False)
    assert torch.equal(device[blocks], original[blocks])
