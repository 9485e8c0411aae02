"""Committing a request's KV into the tree: the request lifecycle over the pools.

A request owns a row of the req-to-token table; its first ``len(prefix_indices)`` slots are
shared with the tree (locked through ``last_node``), the rest it computed itself. When a chunk is
done (``cache_unfinished_req``) or the request ends (``cache_finished_req``), its whole pages go
into the tree; slots the tree already had from another request are freed, and so is a trailing
partial page, which the tree never caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from hicache.errors import InvalidArgumentError
from hicache.keys import RadixKey

if TYPE_CHECKING:
    from hicache.pools.req_to_token import ReqToTokenPool
    from hicache.radix.node import TreeNode
    from hicache.radix.slots import SlotAllocator

__all__ = [
    "CachedRequest",
    "CommitMatch",
    "CommitTree",
    "cache_finished_req",
    "cache_unfinished_req",
]


@dataclass(slots=True)
class CachedRequest:
    """What the tree needs to know of a running request."""

    rid: str
    token_ids: list[int]  # prompt plus generated tokens so far
    req_pool_idx: int  # its row in the req-to-token table
    kv_len: int = 0  # tokens whose KV is in the row
    allocated: int = 0  # slots allocated in the row (whole pages)
    extra_key: str | None = None
    is_bigram: bool = False
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None  # holds one lock on the shared prefix
    priority: int = 0  # of the nodes it commits (the ``priority`` eviction policy)

    def key(self, page_size: int) -> RadixKey:
        tokens = self.token_ids[: self.kv_len]
        return RadixKey(tokens, self.extra_key, self.is_bigram).page_aligned(page_size)


class CommitMatch(Protocol):
    """What a commit reads of the tree's re-match of the committed key."""

    @property
    def prefix_len(self) -> int: ...
    @property
    def last_device_node(self) -> TreeNode: ...
    @property
    def device_indices(self) -> torch.Tensor: ...


class CommitTree(Protocol):
    """What committing a request needs of a tree; a :class:`~hicache.radix.tree.RadixCache` fits.

    ``allocator`` frees the duplicate slots, ``req_to_token`` holds the request's row.
    """

    @property
    def page_size(self) -> int: ...
    @property
    def allocator(self) -> SlotAllocator | None: ...
    @property
    def req_to_token(self) -> ReqToTokenPool | None: ...
    def insert(
        self, key: RadixKey, value: torch.Tensor | None = ..., priority: int = ...
    ) -> int: ...
    def match_prefix(self, key: RadixKey, count_hits: bool = ...) -> CommitMatch: ...
    def inc_lock_ref(self, node: TreeNode) -> None: ...
    def dec_lock_ref(self, node: TreeNode) -> None: ...


def _pools(tree: CommitTree) -> tuple[SlotAllocator, ReqToTokenPool]:
    if tree.allocator is None or tree.req_to_token is None:
        raise InvalidArgumentError("the request lifecycle needs an allocator and a req_to_token")
    return tree.allocator, tree.req_to_token


def _commit(tree: CommitTree, req: CachedRequest) -> tuple[RadixKey, torch.Tensor]:
    """Insert the request's whole pages and free the duplicate slots; (key, row slots)."""
    allocator, table = _pools(tree)
    if req.kv_len > req.allocated or req.kv_len > len(req.token_ids):
        raise InvalidArgumentError(f"request {req.rid}: kv_len {req.kv_len} is inconsistent")
    key = req.key(tree.page_size)
    row = table.table[req.req_pool_idx]
    kv = row[: len(key)].clone()
    shared = len(req.prefix_indices)
    already = tree.insert(key, kv, req.priority) if len(key) else 0
    if already > shared:  # another request cached these pages meanwhile: ours are duplicates
        allocator.free(kv[shared:already])
    return key, row


def cache_finished_req(tree: CommitTree, req: CachedRequest) -> None:
    """Commit a finished request, free its leftover slots and its row, release its lock."""
    key, row = _commit(tree, req)
    allocator, table = _pools(tree)
    if req.allocated > len(key):
        allocator.free(row[len(key) : req.allocated].clone())
    if req.last_node is not None:
        tree.dec_lock_ref(req.last_node)
    table.free(req.req_pool_idx)
    req.last_node = None
    req.allocated = 0


def cache_unfinished_req(tree: CommitTree, req: CachedRequest) -> None:
    """Commit what a running request has computed and move its lock to its new last node.

    Afterwards the request's row points at the tree's slots for its cached prefix, so a
    duplicate computed by this request and freed here is never read again.
    """
    key, row = _commit(tree, req)
    if not len(key):
        return
    match = tree.match_prefix(key, count_hits=False)  # the tree's own re-match: not a hit
    row[: match.prefix_len] = match.device_indices
    tree.inc_lock_ref(match.last_device_node)
    if req.last_node is not None:
        tree.dec_lock_ref(req.last_node)
    req.last_node = match.last_device_node
    req.prefix_indices = match.device_indices
