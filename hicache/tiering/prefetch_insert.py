"""Hanging prefetched pages under a tiered tree as host-only nodes, every pool by its place.

A prefetch reads, per page, the objects of the pools that hold it in L3 and that the hit needs:
the anchor's group on every page, a window pool on the trailing pages of the hit, a state pool's
snapshot at the last page. The new leaf is cut where a token pool's pages begin, so each pool's
host copy covers whole nodes, and the snapshot goes on the last node (it is at its end).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from hicache.keys import RadixKey
from hicache.radix.node import TreeNode
from hicache.tiering.bundler import BundlePage
from hicache.tiering.pool_host import set_host

if TYPE_CHECKING:
    from hicache.tiering.cache import HiRadixCache

__all__ = ["free_bundle", "hang_prefetched"]


def free_bundle(tree: HiRadixCache, pages: Iterable[BundlePage]) -> None:
    """Free every owner pool's host page of ``pages`` (sidecars share their owner's)."""
    owned: dict[str, list[int]] = {}
    for page in pages:
        for name, host_page in page.host_pages.items():
            if name in tree.controller.groups and host_page >= 0:
                owned.setdefault(name, []).append(host_page)
    for name, host_pages in owned.items():
        tree.controller.host_pools[name].free(torch.tensor(host_pages, dtype=torch.int64))


def hang_prefetched(
    tree: HiRadixCache, key: RadixKey, start: int, bundle: list[BundlePage]
) -> tuple[int, TreeNode | None]:
    """See :meth:`HiRadixCache.insert_prefetched`."""
    ps = tree.page_size
    end = start + len(bundle) * ps
    data, unit = tree._pack(key.slice(0, end))
    namespace = (key.extra_key, key.is_bigram)
    root = tree._roots.get(namespace)
    if root is None:
        root = tree._roots[namespace] = tree._make_root(key)
    node, pos, _ = tree._walk(root, data, unit, hit=False)
    have = pos // unit
    if have < start:  # the prefix it continued is gone: nothing to hang the pages from
        free_bundle(tree, bundle)
        return 0, None
    dup = (have - start) // ps
    free_bundle(tree, bundle[:dup])
    fresh = bundle[dup:]
    if pos == len(data):
        return 0, node
    anchor = tree.roles.anchor
    leaf = tree._new_node(node, data[pos:], unit, *namespace)
    leaf.host_value = torch.tensor([p.host_pages[anchor] for p in fresh], dtype=torch.int64)
    leaf.hash_value = [p.page_hash for p in fresh]
    leaf.in_storage = True
    _place_extras(tree, leaf, fresh, unit)
    return len(fresh), leaf


def _place_extras(tree: HiRadixCache, leaf: TreeNode, fresh: list[BundlePage], unit: int) -> None:
    """Give the new ``leaf`` (cut as needed) the extra pools' host pages of ``fresh``."""
    roles, ps = tree.roles, tree.page_size
    firsts = {
        pool: next((i for i, p in enumerate(fresh) if pool in p.host_pages), len(fresh))
        for pool in roles.token_pools
    }
    nodes, starts, seg_start = [], [], 0
    for cut in sorted({i for i in firsts.values() if 0 < i < len(fresh)}):
        nodes.append(tree._split(leaf, (cut - seg_start) * ps * unit, unit))
        starts.append(seg_start)
        seg_start = cut
    nodes.append(leaf)
    starts.append(seg_start)
    unused: list[BundlePage] = []
    for pool, first in firsts.items():
        for node, lo in zip(nodes, starts, strict=True):
            span = fresh[lo : lo + node.length // ps]
            if lo >= first:
                pages = [p.host_pages[pool] for p in span]
                set_host(node, pool, torch.tensor(pages, dtype=torch.int64))
                node.pool_stored = node.pool_stored | {pool}
            else:
                unused += [_only(p, pool) for p in span if pool in p.host_pages]
    for pool in roles.state_pools:
        for i, page in enumerate(fresh):
            if pool not in page.host_pages:
                continue
            if i == len(fresh) - 1:
                set_host(leaf, pool, torch.tensor([page.host_pages[pool]], dtype=torch.int64))
                leaf.pool_stored = leaf.pool_stored | {pool}
            else:
                unused.append(_only(page, pool))
    free_bundle(tree, unused)


def _only(page: BundlePage, pool: str) -> BundlePage:
    return BundlePage(page.namespace, page.page_hash, {pool: page.host_pages[pool]})
