"""Host memory of the tiered cache: allocation that evicts, and what host eviction may take.

Host eviction first removes leaves whose anchor is on host only, unlocked (tree and pool
locks), not protected by an L3 write in flight and not anchoring a prefetch or a load-back, in
the tree's eviction order; a removed leaf may make its parent such a leaf. Another pool's device
data on such a leaf (the anchor's device eviction leaves it there) is freed with it, through the
ledger: without the anchor on any tier it cannot be used. When that is not enough it frees host
copies that are redundant: the node stays on the device and is in L3, so no data is lost.

Extra pools (an SWA window pool, a state pool) have host pools of their own. A host-only leaf
that goes frees its copies in every pool; :meth:`HostEvictor.alloc_pool` evicts such leaves
until the asked pool has room, then drops that pool's host copies that are redundant (the data
is on the device too, or in L3).
"""

from __future__ import annotations

import heapq
from collections import Counter

import torch

from hicache.radix.node import TreeNode
from hicache.tiering.common.metrics import HiCacheMetrics
from hicache.tiering.common.parts import NodeIndex, TierPools
from hicache.tiering.host.pool import drop_host, host_of, host_pools_of

__all__ = ["HostEvictor"]


class HostEvictor:
    """Host pages for the tree's backups and prefetches; host eviction by the tree's policy."""

    def __init__(self, tree: NodeIndex, pools: TierPools, metrics: HiCacheMetrics) -> None:
        self._tree = tree
        self.pools = pools
        self.host_pools = pools.hosts  # by owner pool: the anchor's and each extra pool's
        self.host = pools.hosts[pools.roles.anchor]
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

    def alloc_pool(self, pool: str, count: int) -> torch.Tensor | None:
        """``count`` host pages of extra pool ``pool``, evicting for them if needed; or None."""
        host = self.host_pools[pool]
        pages = host.alloc(count)
        if pages is None:
            self.evict(count - host.available_pages, pool)
            pages = host.alloc(count)
        return pages

    def evict(self, amount: int, pool: str | None = None) -> int:
        """Free at least ``amount`` host units of ``pool`` (default: the anchor's tokens; an
        extra pool counts pages) if possible; the units freed."""
        tree = self._tree
        nodes = tree.all_nodes()
        order = tree.eviction_order
        heap = [(order(n), n.id, n) for n in nodes if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < amount and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            freed += self._remove(node, pool)
            if parent.parent is not None and self._evictable(parent):
                heapq.heappush(heap, (order(parent), parent.id, parent))
        if freed < amount:
            freed += self._drop_redundant_copies(nodes, amount - freed, pool)
        return freed

    def _remove(self, node: TreeNode, pool: str | None) -> int:
        """Take a leaf whose anchor is on host only out of the tree; its units of ``pool``
        freed. Another pool's device data on it (kept there when the anchor was evicted) goes
        with it, freed through the ledger."""
        assert node.host_value is not None  # _evictable
        self._tree.ledger.drop_all(node)
        freed = node.length if pool is None else 0
        for name, pages in host_pools_of(node):
            self.host_pools[name].free(pages)
            freed += len(pages) if name == pool else 0
        node.pool_host = None
        self.host.free(node.host_value)
        node.host_value = None
        self._tree.detach_leaf(node)
        self._metrics.add("host_evicted_tokens", node.length)
        return freed

    def _evictable(self, node: TreeNode) -> bool:
        if node.value is not None or node.host_value is None or node.children:
            return False
        if node.lock_ref > 0 or self.anchors[node.id] > 0 or self._tree.ledger.is_locked(node):
            return False
        if bool(self.host.is_protected(node.host_value).any()):
            return False
        return not any(
            bool(self.host_pools[name].is_protected(pages).any())
            for name, pages in host_pools_of(node)
        )

    def _drop_redundant_copies(self, nodes: list[TreeNode], amount: int, pool: str | None) -> int:
        """Free host copies of ``pool`` (default: the anchor, with every extra pool's) whose
        data stays on the device and is in L3; a later device eviction backs them up again or
        drops them (write policy)."""
        redundant = [n for n in nodes if self._redundant(n, pool)]
        redundant.sort(key=self._tree.eviction_order)
        freed = 0
        for node in redundant:
            if freed >= amount:
                break
            if pool is not None:
                pages = drop_host(node, pool)
                assert pages is not None  # _redundant
                self.host_pools[pool].free(pages)
                freed += len(pages)
                continue
            for name, pages in list(host_pools_of(node)):
                drop_host(node, name)
                self.host_pools[name].free(pages)
            assert node.host_value is not None  # redundant
            self.host.free(node.host_value)
            node.host_value = None
            freed += node.length
            self._metrics.add("host_evicted_tokens", node.length)
        return freed

    def _redundant(self, node: TreeNode, pool: str | None) -> bool:
        if pool is not None:  # an extra pool's copy: kept on the device or in L3
            pages = host_of(node, pool)
            if pages is None or bool(self.host_pools[pool].is_protected(pages).any()):
                return False
            return self._tree.ledger.data(node, pool) is not None or pool in node.pool_stored
        if node.value is None or node.host_value is None or not node.in_storage:
            return False
        if bool(self.host.is_protected(node.host_value).any()):
            return False
        return all(
            name in node.pool_stored and not bool(self.host_pools[name].is_protected(pages).any())
            for name, pages in host_pools_of(node)
        )
