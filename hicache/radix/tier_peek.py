"""What a tree holds of a key on each tier, as a peek (touching nothing) finds it."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.radix.node import TreeNode

__all__ = ["TierPeek"]


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
