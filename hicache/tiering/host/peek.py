"""The tiered cache's peek: what a match would find on device and host, touching nothing.

Schedulers and routers order requests by it every round, so it must not change what the tree
evicts next: no split, no hit counted, no access time refreshed, no write policy triggered.
It applies the hit rules :meth:`~hicache.tiering.cache.HiRadixCache.match_prefix` applies: the
longest prefix every pool can serve from device or host, then the longest part of that every
pool can serve from the device. A match splits a node where either end falls inside it; a split
only cuts a node's data in two, so presence per page, and so both lengths, are the same unsplit.
"""

from __future__ import annotations

from hicache.pools.pool_spec import common_usable_prefix
from hicache.radix.node import TreeNode
from hicache.radix.shadow_rules import PoolRoles, path_presence, peek_path
from hicache.radix.tier_peek import TierPeek
from hicache.tiering.host.pool import held_anywhere

__all__ = ["tiered_peek"]


def tiered_peek(
    roles: PoolRoles, page_size: int, root: TreeNode | None, data: bytes, unit: int
) -> TierPeek:
    """The device hit and the host hit after it of the packed key ``data`` (``unit`` bytes a
    token) under ``root``, as a match would find them (``prefix_len`` and ``host_hit_length``),
    with the node each ends in."""
    ps = page_size
    path, last_bytes = peek_path(root, data, ps * unit)
    anywhere = path_presence(
        roles, path, ps, last_bytes // unit, held_anywhere,
        lambda n: n.value is not None or n.host_value is not None,
    )  # fmt: skip
    total = common_usable_prefix(anywhere) * ps
    path, last_units = _prefix_nodes(path, total)
    device = common_usable_prefix(path_presence(roles, path, ps, last_units)) * ps
    device_path, _ = _prefix_nodes(path, device)
    last_device = device_path[-1] if device_path else None
    return TierPeek(device, total - device, last_device, path[-1] if path else None)


def _prefix_nodes(path: list[TreeNode], units: int) -> tuple[list[TreeNode], int]:
    """The nodes of ``path`` that its first ``units`` units reach, and how many units of the
    last of them those cover (the prefix may end inside it)."""
    depth = 0
    for i, node in enumerate(path):
        if depth + node.length >= units:
            return (path[: i + 1], units - depth) if units > depth else (path[:i], 0)
        depth += node.length
    return path, path[-1].length if path else 0
