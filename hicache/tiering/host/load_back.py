"""Host-to-device load-back of a tiered tree's prefix, every pool by its hit rule.

A prefix ending at a node needs, on the device: the anchor's slots on every node of its path,
and each extra pool's data on the nodes its rule names (an SWA pool's window, a state pool's end
node; see :func:`~hicache.tiering.host.pool.needed_nodes`). Load-back copies from host whatever
of that the device lacks, all or nothing: slots are allocated for every pool first (evicting
for them), and nothing is copied when any allocation fails.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from hicache.radix.node import TreeNode
from hicache.tiering.common.metrics import HiCacheMetrics
from hicache.tiering.common.parts import DeviceRoom, GroupTransfer, HostCopies, TierPools
from hicache.tiering.host.pool import host_of, needed_nodes

__all__ = ["LoadBack"]

_NONE = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False, slots=True)
class LoadBack:
    """Loads host copies of a tiered tree's prefixes back to the device.

    ``anchors`` counts, per node id, the prefetches and load-backs hanging from it (host
    eviction keeps their host chain); an anchor span under ``threshold_tokens`` is not loaded.
    """

    tree: DeviceRoom
    pools: TierPools
    copies: HostCopies
    anchors: Counter[int]
    metrics: HiCacheMetrics
    threshold_tokens: int

    def load(
        self, node: TreeNode, mem_quota: int | None = None
    ) -> tuple[torch.Tensor, TreeNode, GroupTransfer | None]:
        """Load what the prefix ending at ``node`` lacks on the device; (the anchor slots
        loaded, ``node`` when the whole prefix is on the device now (or on its way) else an
        ancestor of it, the copy started or None). See :meth:`HiRadixCache.init_load_back`."""
        planned = self._plan(node)
        if planned is None:
            return _NONE, _short_of(node, []), None
        chain, extras = planned
        tokens = sum(n.length for n in chain)
        top = _short_of(node, chain)
        if not chain and not extras:
            return _NONE, node, None
        if chain and tokens < self.threshold_tokens:
            return _NONE, top, None
        if mem_quota is not None and tokens > mem_quota:
            return _NONE, top, None
        anchor = self.pools.roles.anchor
        plan = {anchor: chain, **extras} if chain else extras
        slots = self._allocate(node, plan)
        if slots is None:
            return _NONE, top, None
        if not _on_host(anchor, plan):  # making room (write_back) evicted a planned host copy
            for name, taken in slots.items():
                self.tree.allocators[name].free(taken)
            return _NONE, top, None
        transfers = []
        for pool, nodes in plan.items():
            pages = torch.cat([_host(n, pool if pool != anchor else None) for n in nodes])
            transfers.append(self.copies.load(pages, slots[pool], owner=pool))
            self._assign(pool, nodes, slots[pool])
        self.tree.requeue(node)
        self.metrics.add("host_hit_tokens", tokens)
        return slots.get(anchor, _NONE), node, GroupTransfer.merged(transfers)

    def _plan(self, node: TreeNode) -> tuple[list[TreeNode], dict[str, list[TreeNode]]] | None:
        """(the anchor chain on host only, root first; per extra pool, the nodes to load, root
        first), or None when some needed data is on neither tier."""
        chain: list[TreeNode] = []
        walk = node
        while walk.parent is not None and walk.value is None:
            chain.append(walk)
            walk = walk.parent
        chain.reverse()
        extras: dict[str, list[TreeNode]] = {}
        roles, ledger = self.pools.roles, self.tree.ledger
        for pool in roles.extra:
            nodes = needed_nodes(roles, pool, node, self.pools.page_size)
            missing = [n for n in reversed(nodes) if ledger.data(n, pool) is None]
            if any(host_of(n, pool) is None for n in missing):
                return None
            if missing:
                extras[pool] = missing
        return chain, extras

    def _alloc(self, pool: str, count: int) -> torch.Tensor | None:
        """``count`` device slots of ``pool`` (the anchor: by tree eviction; others: by pool)."""
        tree = self.tree
        allocator = tree.allocators[pool]
        slots = allocator.alloc(count)
        if slots is None:
            if pool == self.pools.roles.anchor:
                tree.evict(count)
            else:
                tree.evict_pool(pool, count)
            slots = allocator.alloc(count)
        return slots

    def _units(self, pool: str, nodes: list[TreeNode]) -> int:
        if pool in self.pools.roles.state_pools:
            return len(nodes)
        return sum(n.length for n in nodes)

    def _allocate(
        self, node: TreeNode, plan: dict[str, list[TreeNode]]
    ) -> dict[str, torch.Tensor] | None:
        """Device slots for every pool of ``plan``, with the path kept meanwhile; or None."""
        tree, extra = self.tree, self.pools.roles.extra
        ancestor = node
        while ancestor.parent is not None and ancestor.value is None:
            ancestor = ancestor.parent
        tree.inc_lock_ref(ancestor)  # keep the device prefix while making room below it
        self.anchors[node.id] += 1  # and the host chain, which eviction might take
        for pool in extra:
            tree.ledger.lock(node, pool)  # and what each pool holds of the prefix already
        got: dict[str, torch.Tensor] = {}
        try:
            for pool, nodes in plan.items():
                slots = self._alloc(pool, self._units(pool, nodes))
                if slots is None:
                    for name, taken in got.items():
                        tree.allocators[name].free(taken)
                    return None
                got[pool] = slots
        finally:
            for pool in extra:
                tree.ledger.unlock(node, pool)
            self.anchors[node.id] -= 1
            tree.dec_lock_ref(ancestor)
        return got

    def _assign(self, pool: str, nodes: list[TreeNode], slots: torch.Tensor) -> None:
        state, anchor = pool in self.pools.roles.state_pools, pool == self.pools.roles.anchor
        offset = 0
        for n in nodes:
            size = 1 if state else n.length
            piece = slots[offset : offset + size]
            offset += size
            if anchor:
                self.tree.restore_device_slots(n, piece)
            else:
                self.tree.ledger.put(n, pool, piece)


def _short_of(node: TreeNode, chain: list[TreeNode]) -> TreeNode:
    """What a load-back that loads nothing returns: the node above the anchor's host-only chain,
    or ``node``'s parent when only another pool's data was missing (never ``node`` itself,
    which would say the prefix is on the device)."""
    top = chain[0].parent if chain else node.parent
    return top if top is not None else node  # a namespace root: nothing to load anyway


def _on_host(anchor: str, plan: dict[str, list[TreeNode]]) -> bool:
    """Whether every node of ``plan`` still has its host copy of the pool it is planned for."""
    for pool, nodes in plan.items():
        for n in nodes:
            if (n.host_value if pool == anchor else host_of(n, pool)) is None:
                return False
    return True


def _host(node: TreeNode, pool: str | None) -> torch.Tensor:
    """``node``'s host pages of ``pool`` (None: the anchor); the plan made sure they exist."""
    pages = node.host_value if pool is None else host_of(node, pool)
    if pages is None:
        raise AssertionError(f"node {node.id} has no host copy of {pool or 'the anchor'}")
    return pages
