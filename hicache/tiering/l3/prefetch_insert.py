"""Hanging prefetched pages under a tiered tree as host-only nodes, every pool by its place.

A prefetch reads, per page, the objects of the pools that hold it in L3 and that the hit needs:
the anchor's group on every page, a window pool on the trailing pages of the hit, a state pool's
snapshot at the last page. The new leaf is cut where a token pool's pages begin, so each pool's
host copy covers whole nodes (:func:`~hicache.tiering.host.pool.hang_host_pages`, which also
places the pages an engine computed on host), and the snapshot goes on the last node (it is at
its end).
"""

from __future__ import annotations

import torch

from hicache.keys import RadixKey
from hicache.radix.node import TreeNode
from hicache.tiering.common.parts import NodeGrafts, TierPools
from hicache.tiering.host.pool import hang_host_pages, set_host
from hicache.tiering.l3.bundler import BundlePage

__all__ = ["PrefetchInserter"]


class PrefetchInserter:
    """Hangs the pages of finished prefetches under ``tree``; frees the host pages it does not
    keep (through ``pools``)."""

    def __init__(self, tree: NodeGrafts, pools: TierPools) -> None:
        self._tree = tree
        self.pools = pools

    def insert(
        self, key: RadixKey, start: int, bundle: list[BundlePage]
    ) -> tuple[int, TreeNode | None]:
        """See :meth:`HiRadixCache.insert_prefetched`."""
        pools = self.pools
        end = start + len(bundle) * pools.page_size
        node, have, leaf = self._tree.hang_leaf(key.slice(0, end), start)
        if have < start:  # the prefix it continued is gone: nothing to hang the pages from
            pools.free_pages(bundle)
            return 0, None
        dup = (have - start) // pools.page_size
        pools.free_pages(bundle[:dup])
        fresh = bundle[dup:]
        if leaf is None:
            return 0, node
        anchor = pools.roles.anchor
        leaf.host_value = torch.tensor([p.host_pages[anchor] for p in fresh], dtype=torch.int64)
        leaf.hash_value = [p.page_hash for p in fresh]
        leaf.in_storage = True
        self._place_extras(leaf, fresh)
        return len(fresh), leaf

    def _place_extras(self, leaf: TreeNode, fresh: list[BundlePage]) -> None:
        """Give the new ``leaf`` (cut as needed) the extra pools' host pages of ``fresh``."""
        roles, ps = self.pools.roles, self.pools.page_size
        pages: dict[str, tuple[int, torch.Tensor]] = {}
        for pool in roles.token_pools:
            first = next((i for i, p in enumerate(fresh) if pool in p.host_pages), len(fresh))
            if first < len(fresh):  # a token pool's pages run from its first page to the end
                held = [p.host_pages[pool] for p in fresh[first:]]
                pages[pool] = (first, torch.tensor(held, dtype=torch.int64))
        hang_host_pages(self._tree, leaf, pages, ps, stored=True)
        unused: list[BundlePage] = []
        for pool in roles.state_pools:
            for i, page in enumerate(fresh):
                if pool not in page.host_pages:
                    continue
                if i == len(fresh) - 1:
                    set_host(leaf, pool, torch.tensor([page.host_pages[pool]], dtype=torch.int64))
                    leaf.pool_stored = leaf.pool_stored | {pool}
                else:
                    unused.append(_only(page, pool))
        self.pools.free_pages(unused)


def _only(page: BundlePage, pool: str) -> BundlePage:
    return BundlePage(page.namespace, page.page_hash, {pool: page.host_pages[pool]})
