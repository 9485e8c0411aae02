"""What a tree holds of a key on each tier, as a peek (touching nothing) finds it."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.radix.node import TreeNode
from hicache.radix.packing import common_prefix_bytes

__all__ = ["TierPeek", "peek_tiers"]


@dataclass(frozen=True, slots=True)
class TierPeek:
    """How much of a key a tree holds on each tier, found without touching the tree.

    ``device`` units are usable from the device; the ``host`` units after them would be loaded
    back from host first (a tiered tree's host hit). ``last_device_node`` and ``last_node`` are
    the deepest nodes the device part and the whole match reach (a match may end inside one), or
    None where that part is empty. Built by :meth:`RadixCache.peek_tiers`.
    """

    device: int
    host: int = 0
    last_device_node: TreeNode | None = None
    last_node: TreeNode | None = None

    @property
    def total(self) -> int:
        """Units that need no computing: the device hit and the host hit."""
        return self.device + self.host

    def weighted(self, host_weight: float) -> float:
        """The device hit plus ``host_weight`` times the host hit: what the prefix is worth
        when loading a host page saves only that share of recomputing it."""
        return self.device + host_weight * self.host


def peek_tiers(root: TreeNode | None, data: bytes, unit: int, page_size: int) -> TierPeek:
    """How much of the packed key ``data`` (``unit`` bytes a unit) the tree under ``root``
    holds on the device, and on host after that, touching nothing (no split, no hit, no access
    time): :meth:`RadixCache.peek_tiers`.

    A node is on host when it holds host pages and no device slots, as a tiered tree leaves a
    node it evicted after backing it up; the device part ends at the first such node and the
    rest of the match is the host part (device nodes form the top of such a tree).
    """
    page_bytes = page_size * unit
    node, pos, device_end = root, 0, -1
    deepest: TreeNode | None = None
    last_device: TreeNode | None = None
    while node is not None and pos < len(data):
        child = node.children.get(data[pos : pos + page_bytes])
        if child is None:
            break
        if device_end < 0 and child.value is None and child.host_value is not None:
            device_end = pos
        deepest = child
        last_device = child if device_end < 0 else last_device
        if not data.startswith(child.key, pos):
            pos += common_prefix_bytes(child.key, data, pos, page_bytes)
            break
        pos += len(child.key)
        node = child
    device_end = pos if device_end < 0 else device_end
    return TierPeek(device_end // unit, (pos - device_end) // unit, last_device, deepest)
