"""The host side of a tiered tree's extra pools: each node's host copy per pool, and what
each pool's hit rule needs of a prefix's nodes (load-back) and of its pages (prefetch).

The anchor pool's host copy is ``node.host_value`` (one host page per token page). An extra pool
(an SWA window pool, a state pool; see :mod:`hicache.radix.shadow_rules`) keeps its host copy in
``node.pool_host[pool]``: a token pool's host pages (one per token page of the node's span), a
state pool's one host page (the snapshot at the node's end), or ``None``. A node holds an extra
pool's host copy only while its anchor is on host too, so what is on host stays a tree.

Which nodes a pool needs for a prefix ending at a node (:func:`needed_nodes`) follows the pool's
hit rule: every node for ALL_PAGES, the nodes of the trailing window for TRAILING_PAGES, the end
node for a state pool. What a prefetch reads (:func:`plan_reads`) follows the same rules over
pages: the storage tier passes which objects L3 holds for each candidate page (by pool name), and
gets back how many leading pages are usable and, for each of them, the pools to read. A pool is
held on a page when every pool of its group is (a sidecar's object beside its owner's). Pages
before the first candidate are in the tree already and count as held by every pool, so a window
that reaches back before the candidates is taken to be there (the tree's own hit rules decide
again when the request is matched).

New host-only nodes get their pages here, whoever read or computed them: :func:`hang_host_pages`
gives a new leaf each extra pool's host pages, cutting it where a pool's pages begin (L3
prefetches, :mod:`~hicache.tiering.l3.prefetch_insert`); :func:`hang_host_leaf` hangs pages an
engine computed on host (HiSparse's output, a :class:`ComputedHostPages`) as a new leaf with its
anchor's and extra pools' pages.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache.keys import RadixKey
from hicache.pools.pool_spec import HitRuleKind, common_usable_prefix
from hicache.radix.node import TreeNode
from hicache.radix.shadow_rules import PoolRoles
from hicache.tiering.common.parts import NodeGrafts, TierPools

__all__ = [
    "ComputedHostPages",
    "ExtraPages",
    "drop_host",
    "hang_host_leaf",
    "hang_host_pages",
    "held_anywhere",
    "host_of",
    "host_pools_of",
    "needed_nodes",
    "plan_reads",
    "set_host",
    "split_host",
]


# Per extra token pool: (first position, host pages from there on).
ExtraPages = Mapping[str, tuple[int, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class ComputedHostPages:
    """Pages an engine computed on host past ``start`` (whole pages) of ``key``, to hang under
    ``key``'s cached path as host-only nodes: ``anchor_pages`` (one per page of ``key`` from
    ``start``) and, per extra token pool, (first position, host pages to the end of ``key``);
    the new leaf gets ``priority``."""

    key: RadixKey
    start: int
    anchor_pages: torch.Tensor
    extras: ExtraPages
    priority: int = 0


def host_of(node: TreeNode, pool: str) -> torch.Tensor | None:
    """``pool``'s host pages on ``node`` (an extra owner pool), or None."""
    return None if node.pool_host is None else node.pool_host.get(pool)


def set_host(node: TreeNode, pool: str, pages: torch.Tensor | None) -> None:
    if node.pool_host is None:
        node.pool_host = {}
    node.pool_host[pool] = pages


def drop_host(node: TreeNode, pool: str) -> torch.Tensor | None:
    """Take ``pool``'s host pages off ``node`` (the caller frees them); None if it had none."""
    pages = host_of(node, pool)
    if pages is not None:
        set_host(node, pool, None)
        node.pool_stored = node.pool_stored - {pool}
    return pages


def host_pools_of(node: TreeNode) -> Iterator[tuple[str, torch.Tensor]]:
    """Every extra pool's host pages on ``node``."""
    for pool, pages in (node.pool_host or {}).items():
        if pages is not None:
            yield pool, pages


def held_anywhere(node: TreeNode, pool: str) -> bool:
    """Whether ``node`` holds ``pool``'s data on the device or on host."""
    values = node.pool_values
    on_device = values is not None and values.get(pool) is not None
    return on_device or host_of(node, pool) is not None


def split_host(roles: PoolRoles, child: TreeNode, upper: TreeNode, pages: int) -> None:
    """Follow the tree's split of ``child`` after ``pages`` token pages into ``upper``: token
    pools' host pages are cut there, a snapshot stays with ``child`` (it is at its end)."""
    upper.pool_stored = child.pool_stored - set(roles.state_pools)
    if not child.pool_host:
        return
    upper.pool_host = {}
    for pool in roles.token_pools:
        host = child.pool_host.get(pool)
        if host is not None:
            upper.pool_host[pool], child.pool_host[pool] = host[:pages], host[pages:]


def hang_host_pages(
    tree: NodeGrafts,
    leaf: TreeNode,
    pages: Mapping[str, tuple[int, torch.Tensor]],
    page_size: int,
    stored: bool = False,
) -> list[TreeNode]:
    """Give a new host-only ``leaf`` (its anchor's host pages set) token pools' host pages:
    ``pages[pool]`` is (the page of the leaf where ``pool``'s pages begin, one host page per
    page of the leaf from there). The leaf is cut where a pool's pages begin after its first
    page (its anchor's and every page-wide pool's pages cut with it), so each pool's host copy
    covers whole nodes; ``stored``: the copies are in L3 too. The nodes it became, in path
    order (``leaf`` last)."""
    nodes, starts, seg_start = [], [], 0
    for cut in sorted(
        {first for first, _ in pages.values() if 0 < first < leaf.length // page_size}
    ):
        nodes.append(tree.split_node(leaf, (cut - seg_start) * page_size))
        starts.append(seg_start)
        seg_start = cut
    nodes.append(leaf)
    starts.append(seg_start)
    for pool, (first, host) in pages.items():
        for node, lo in zip(nodes, starts, strict=True):
            if lo >= first:
                set_host(node, pool, host[lo - first : lo - first + node.length // page_size])
                if stored:
                    node.pool_stored = node.pool_stored | {pool}
    return nodes


def hang_host_leaf(
    tree: NodeGrafts, pools: TierPools, computed: ComputedHostPages
) -> tuple[int, list[TreeNode]]:
    """Hang ``computed`` under its key's cached path, as a new host-only leaf.

    Returns how many of its ``anchor_pages`` the tree took (the last ones: the tree held the
    others) and the nodes that took pages, in path order. The extra pools' pages are the
    tree's, or freed, whatever happened; the anchor pages not taken stay the caller's.
    """
    ps, start = pools.page_size, computed.start
    _, have, leaf = tree.hang_leaf(computed.key, start)
    if leaf is None:  # all there already (or, never here, its prefix gone)
        for name, (_, host) in computed.extras.items():
            pools.hosts[name].free(host)
        return 0, []
    taken = computed.anchor_pages[have // ps - start // ps :].clone()
    leaf.host_value = taken
    leaf.priority = computed.priority
    placed: dict[str, tuple[int, torch.Tensor]] = {}
    for name, (first, host) in computed.extras.items():
        skip = max(0, have - first) // ps  # positions the tree held already: freed
        if skip:
            pools.hosts[name].free(host[:skip])
        placed[name] = (max(0, first - have) // ps, host[skip:])
    return len(taken), hang_host_pages(tree, leaf, placed, ps)


def needed_nodes(roles: PoolRoles, pool: str, end_node: TreeNode, page_size: int) -> list[TreeNode]:
    """The nodes of the path ending at ``end_node`` whose ``pool`` data a prefix ending there
    needs (nearest first): all of them, a window's, or the end node only (state)."""
    path = end_node.path_to_root()
    if pool in roles.state_pools:
        return path[:1]
    rule = roles.rules[pool]
    if rule.kind is not HitRuleKind.TRAILING_PAGES:
        return path
    need, out = rule.pages * page_size, []
    for node in path:
        if need <= 0:
            break
        out.append(node)
        need -= node.length
    return out


def plan_reads(
    roles: PoolRoles, found: Sequence[Mapping[str, bool]]
) -> tuple[int, list[frozenset[str]]]:
    """(usable pages, per usable page the pools to read: the owners and their sidecars)."""
    groups: dict[str, list[str]] = {}
    for name, owner in roles.owner_of.items():
        groups.setdefault(owner, []).append(name)
    held = {
        owner: [all(page.get(name, False) for name in members) for page in found]
        for owner, members in groups.items()
    }
    hit = common_usable_prefix([(roles.rules[owner], held[owner]) for owner in groups])
    reads: list[set[str]] = [set() for _ in range(hit)]
    for owner, members in groups.items():
        for i in _needed_pages(roles, owner, hit):
            reads[i].update(members)
    return hit, [frozenset(r) for r in reads]


def _needed_pages(roles: PoolRoles, owner: str, hit: int) -> range:
    """The pages of a ``hit``-page prefix whose ``owner`` data the prefix needs."""
    if hit == 0:
        return range(0)
    if owner in roles.state_pools:
        return range(hit - 1, hit)
    rule = roles.rules[owner]
    if rule.kind is HitRuleKind.TRAILING_PAGES:
        return range(max(0, hit - rule.pages), hit)
    return range(hit)
