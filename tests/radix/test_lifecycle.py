"""The request lifecycle over real pools: commit, free duplicates, move locks, no leaks."""

from __future__ import annotations

import pytest
import torch

from hicache.errors import DoubleFreeError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.pools import ReqToTokenPool, TokenSlotAllocator
from hicache.radix import RadixCache, RadixCacheConfig
from hicache.radix.lifecycle import CachedRequest

PAGE = 4


def setup(slots: int = 256) -> tuple[RadixCache, TokenSlotAllocator, ReqToTokenPool]:
    allocator = TokenSlotAllocator(slots, PAGE)
    table = ReqToTokenPool(8, 128)
    tree = RadixCache(RadixCacheConfig(page_size=PAGE), allocator=allocator, req_to_token=table)
    return tree, allocator, table


def start(tree: RadixCache, table: ReqToTokenPool, rid: str, tokens: list[int]) -> CachedRequest:
    """Match the prompt, lock the prefix, allocate pages for the rest: what a scheduler does."""
    row = table.alloc()
    assert row is not None
    match = tree.match_prefix(RadixKey(tokens))
    tree.inc_lock_ref(match.last_device_node)
    shared = match.prefix_len
    need = -(-len(tokens) // PAGE) * PAGE - shared
    fresh = tree.allocator.alloc(need)
    assert fresh is not None
    table.table[row, :shared] = match.device_indices
    table.table[row, shared : shared + need] = fresh
    return CachedRequest(
        rid, list(tokens), row, kv_len=len(tokens), allocated=shared + need,
        prefix_indices=match.device_indices, last_node=match.last_device_node,
    )  # fmt: skip


def test_finished_request_is_cached_and_leaves_no_leak() -> None:
    tree, allocator, table = setup()
    free0 = allocator.available_size
    req = start(tree, table, "a", list(range(10)))  # 3 pages: 8 cached, 2 tail tokens
    tree.cache_finished_req(req)
    assert tree.total_size == 8 and tree.protected_size == 0
    assert allocator.available_size == free0 - 8  # the partial tail page came back
    assert table.available_size == 8
    match = tree.match_prefix(RadixKey(list(range(10))))
    assert match.prefix_len == 8
    assert match.device_indices.tolist() == table.table[req.req_pool_idx, :8].tolist()
    assert tree.evict(100) == 8 and allocator.available_size == free0


def test_second_request_reuses_the_prefix_and_duplicates_are_freed() -> None:
    tree, allocator, table = setup()
    free0 = allocator.available_size
    a = start(tree, table, "a", list(range(8)))
    b = start(tree, table, "b", list(range(8)))  # started before a was cached: computes twice
    assert b.prefix_indices.numel() == 0
    tree.cache_finished_req(a)
    tree.cache_finished_req(b)  # its 8 slots duplicate a's and are freed
    assert tree.total_size == 8 and allocator.available_size == free0 - 8
    c = start(tree, table, "c", [*range(8), 50, 51, 52, 53])
    assert (
        c.prefix_indices.tolist()
        == tree.match_prefix(RadixKey(list(range(8)))).device_indices.tolist()
    )
    assert tree.protected_size == 8
    tree.cache_finished_req(c)
    assert tree.protected_size == 0 and tree.total_size == 12
    assert tree.evict(100) == 12 and allocator.available_size == free0


def test_unfinished_request_commits_chunks_and_moves_its_lock() -> None:
    tree, allocator, table = setup()
    free0 = allocator.available_size
    tokens = list(range(20))
    req = start(tree, table, "a", tokens)
    req.kv_len = 9  # first chunk done: 2 whole pages
    tree.cache_unfinished_req(req)
    assert tree.total_size == 8 and tree.protected_size == 8
    assert req.last_node is not None and req.prefix_indices.numel() == 8
    other = start(tree, table, "b", [*tokens[:8], 99, 98, 97, 96])
    assert other.prefix_indices.tolist() == req.prefix_indices.tolist()
    req.kv_len = 20  # second chunk done
    tree.cache_unfinished_req(req)
    assert tree.total_size == 20 and req.prefix_indices.numel() == 20  # b has not committed
    assert tree.protected_size == 20
    tree.cache_finished_req(req)
    tree.cache_finished_req(other)
    assert tree.protected_size == 0
    assert tree.total_size == 24  # b's own page [99, 98, 97, 96] joined at its finish
    assert tree.evict(1000) == 24 and allocator.available_size == free0


def test_inconsistent_request_is_refused() -> None:
    tree, _, table = setup()
    req = start(tree, table, "a", list(range(8)))
    req.kv_len = 99
    with pytest.raises(InvalidArgumentError):
        tree.cache_finished_req(req)
    bare = RadixCache(RadixCacheConfig(page_size=PAGE))
    with pytest.raises(InvalidArgumentError):
        bare.cache_finished_req(req)


def test_allocator_is_all_or_nothing_and_detects_double_frees() -> None:
    allocator = TokenSlotAllocator(16, 4)
    a = allocator.alloc(8)
    assert a is not None and a.tolist() == list(range(8))
    assert allocator.alloc(12) is None and allocator.available_size == 8
    with pytest.raises(InvalidArgumentError):
        allocator.alloc(3)
    allocator.free(a[:4])
    with pytest.raises(DoubleFreeError):
        allocator.free(a)  # page 0 is already free: nothing changes
    assert allocator.available_size == 12
    with pytest.raises(DoubleFreeError):
        allocator.free(torch.cat([a[4:], a[4:]]))
    with pytest.raises(InvalidArgumentError):
        allocator.free(torch.tensor([64, 65, 66, 67]))
    table = ReqToTokenPool(1, 4)
    row = table.alloc()
    assert row == 0 and table.alloc() is None
    table.free(0)
    with pytest.raises(DoubleFreeError):
        table.free(0)
