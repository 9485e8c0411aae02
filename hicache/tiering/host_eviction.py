"""Host memory of the tiered cache: allocation that evicts, and what host eviction may take.

Host eviction first removes leaves that are on host only, unlocked, not protected by an L3
write in flight and not anchoring a prefetch or a load-back, in the tree's eviction order; a
removed leaf may make its parent such a leaf. When that is not enough it frees host copies
that are redundant: the node stays on the device and is in L3, so no data is lost.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import TYPE_CHECKING

import torch

from hicache.pools.host import HostPool
from hicache.radix.node import TreeNode
from hicache.tiering.metrics import HiCacheMetrics

if TYPE_CHECKING:
    from hicache.tiering.cache import HiRadixCache

__all__ = ["HostEvictor"]


class HostEvictor:
    """Host pages for the tree's backups and prefetches; host eviction by the tree's policy."""

    def __init__(self, tree: HiRadixCache, host: HostPool, metrics: HiCacheMetrics) -> None:
        self._tree = tree
        self.host = host
        # Node id -> prefetches and load-backs hanging from it: their host chain stays.
        self.anchors: Counter[int] = Counter()
        self._metrics = metrics

    def alloc(self, n_pages: int) -> torch.Tensor | None:
        """``n_pages`` host pages, evicting host-only leaves for them if needed; or None."""
        pages = self.host.alloc(n_pages)
        if pages is None:
            self.evict(n_pages * self.host.page_size)
            pages = self.host.alloc(n_pages)
        return pages

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens if possible; the tokens freed."""
        tree = self._tree
        nodes = tree.all_nodes()
        order = tree.eviction_order
        heap = [(order(n), n.id, n) for n in nodes if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            assert node.host_value is not None  # _evictable
            self.host.free(node.host_value)
            node.host_value = None
            tree.detach_leaf(node)
            freed += node.length
            if parent.parent is not None and self._evictable(parent):
                heapq.heappush(heap, (order(parent), parent.id, parent))
        if freed < num_tokens:
            freed += self._drop_redundant_copies(nodes, num_tokens - freed)
        self._metrics.add("host_evicted_tokens", freed)
        return freed

    def _evictable(self, node: TreeNode) -> bool:
        if node.value is not None or node.host_value is None or node.children:
            return False
        if node.lock_ref > 0 or self.anchors[node.id] > 0:
            return False
        return not bool(self.host.is_protected(node.host_value).any())

    def _drop_redundant_copies(self, nodes: list[TreeNode], num_tokens: int) -> int:
        """Free host copies of nodes that stay on the device and are in L3; a later device
        eviction backs them up again or drops them (write policy)."""
        redundant = [
            n
            for n in nodes
            if n.value is not None
            and n.host_value is not None
            and n.in_storage
            and not bool(self.host.is_protected(n.host_value).any())
        ]
        redundant.sort(key=self._tree.eviction_order)
        freed = 0
        for node in redundant:
            if freed >= num_tokens:
                break
            assert node.host_value is not None  # redundant
            self.host.free(node.host_value)
            node.host_value = None
            freed += node.length
        return freed
