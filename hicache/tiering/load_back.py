"""Host-to-device load-back of a tiered tree's prefix, every pool by its hit rule.

A prefix ending at a node needs, on the device: the anchor's slots on every node of its path,
and each extra pool's data on the nodes its rule names (an SWA pool's window, a state pool's end
node; see :func:`~hicache.tiering.pool_host.needed_nodes`). Load-back copies from host whatever
of that the device lacks, all or nothing: slots are allocated for every pool first (evicting
for them), and nothing is copied when any allocation fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.radix.node import TreeNode
from hicache.tiering.controller import GroupTransfer
from hicache.tiering.pool_host import host_of, needed_nodes

if TYPE_CHECKING:
    from hicache.tiering.cache import HiRadixCache

__all__ = ["load_back"]

_NONE = torch.empty(0, dtype=torch.int64)


def _plan(
    tree: HiRadixCache, node: TreeNode
) -> tuple[list[TreeNode], dict[str, list[TreeNode]]] | None:
    """(the anchor chain on host only, root first; per extra pool, the nodes to load, root
    first), or None when some needed data is on neither tier."""
    chain: list[TreeNode] = []
    walk = node
    while walk.parent is not None and walk.value is None:
        chain.append(walk)
        walk = walk.parent
    chain.reverse()
    extras: dict[str, list[TreeNode]] = {}
    for pool in tree.roles.extra:
        nodes = needed_nodes(tree.roles, pool, node, tree.page_size)
        missing = [n for n in reversed(nodes) if tree.ledger.data(n, pool) is None]
        if any(host_of(n, pool) is None for n in missing):
            return None
        if missing:
            extras[pool] = missing
    return chain, extras


def _short_of(node: TreeNode, chain: list[TreeNode]) -> TreeNode:
    """What a load-back that loads nothing returns: the node above the anchor's host-only chain,
    or ``node``'s parent when only another pool's data was missing (never ``node`` itself,
    which would say the prefix is on the device)."""
    top = chain[0].parent if chain else node.parent
    return top if top is not None else node  # a namespace root: nothing to load anyway


def _alloc(tree: HiRadixCache, pool: str, count: int) -> torch.Tensor | None:
    """``count`` device slots of ``pool`` (the anchor: by tree eviction; others: by pool)."""
    allocator = tree.allocators[pool]
    slots = allocator.alloc(count)
    if slots is None:
        if pool == tree.roles.anchor:
            tree.evict(count)
        else:
            tree.evict_pool(pool, count)
        slots = allocator.alloc(count)
    return slots


def _units(tree: HiRadixCache, pool: str, nodes: list[TreeNode]) -> int:
    return len(nodes) if pool in tree.roles.state_pools else sum(n.length for n in nodes)


def _allocate(
    tree: HiRadixCache, node: TreeNode, plan: dict[str, list[TreeNode]]
) -> dict[str, torch.Tensor] | None:
    """Device slots for every pool of ``plan``, with the path kept meanwhile; or None."""
    ancestor = node
    while ancestor.parent is not None and ancestor.value is None:
        ancestor = ancestor.parent
    tree.inc_lock_ref(ancestor)  # keep the device prefix while making room below it
    tree.host_evictor.anchors[node.id] += 1  # and the host chain, which eviction might take
    for pool in tree.roles.extra:
        tree.ledger.lock(node, pool)  # and what each pool holds of the prefix already
    got: dict[str, torch.Tensor] = {}
    try:
        for pool, nodes in plan.items():
            slots = _alloc(tree, pool, _units(tree, pool, nodes))
            if slots is None:
                for name, taken in got.items():
                    tree.allocators[name].free(taken)
                return None
            got[pool] = slots
    finally:
        for pool in tree.roles.extra:
            tree.ledger.unlock(node, pool)
        tree.host_evictor.anchors[node.id] -= 1
        tree.dec_lock_ref(ancestor)
    return got


def load_back(
    tree: HiRadixCache, node: TreeNode, mem_quota: int | None = None
) -> tuple[torch.Tensor, TreeNode]:
    """Load what the prefix ending at ``node`` lacks on the device; (the anchor slots loaded,
    ``node`` when the whole prefix is on the device now (or on its way), else an ancestor of
    it, nothing loaded). See :meth:`HiRadixCache.init_load_back`."""
    planned = _plan(tree, node)
    if planned is None:
        return _NONE, _short_of(node, [])
    chain, extras = planned
    tokens = sum(n.length for n in chain)
    top = _short_of(node, chain)
    if not chain and not extras:
        return _NONE, node
    if chain and tokens < tree.tiers.load_back_threshold_tokens:
        return _NONE, top
    if mem_quota is not None and tokens > mem_quota:
        return _NONE, top
    plan = {tree.roles.anchor: chain, **extras} if chain else extras
    slots = _allocate(tree, node, plan)
    if slots is None:
        return _NONE, top
    if not _on_host(tree, plan):  # making room (write_back) evicted a planned host copy
        for name, taken in slots.items():
            tree.allocators[name].free(taken)
        return _NONE, top
    transfers = []
    for pool, nodes in plan.items():
        anchor = pool == tree.roles.anchor
        pages = torch.cat([_host(n, pool if not anchor else None) for n in nodes])
        transfers.append(tree.controller.load(pages, slots[pool], owner=pool))
        _assign(tree, pool, nodes, slots[pool])
    tree.pending_loads.append(GroupTransfer.merged(transfers))
    tree._requeue(node)
    tree.metrics.add("host_hit_tokens", tokens)
    return slots.get(tree.roles.anchor, _NONE), node


def _assign(tree: HiRadixCache, pool: str, nodes: list[TreeNode], slots: torch.Tensor) -> None:
    offset = 0
    for n in nodes:
        size = 1 if pool in tree.roles.state_pools else n.length
        piece = slots[offset : offset + size]
        offset += size
        if pool == tree.roles.anchor:
            n.value = piece
            tree.evictable_size += n.length
        else:
            tree.ledger.put(n, pool, piece)


def _on_host(tree: HiRadixCache, plan: dict[str, list[TreeNode]]) -> bool:
    """Whether every node of ``plan`` still has its host copy of the pool it is planned for."""
    for pool, nodes in plan.items():
        anchor = pool == tree.roles.anchor
        for n in nodes:
            if (n.host_value if anchor else host_of(n, pool)) is None:
                return False
    return True


def _host(node: TreeNode, pool: str | None) -> torch.Tensor:
    """``node``'s host pages of ``pool`` (None: the anchor); the plan made sure they exist."""
    pages = node.host_value if pool is None else host_of(node, pool)
    if pages is None:
        raise AssertionError(f"node {node.id} has no host copy of {pool or 'the anchor'}")
    return pages
