"""SLRU's protected segment: the nodes a match hit, least recently hit first.

Under :attr:`~hicache.radix.eviction.EvictionPolicy.SLRU` a hit moves a node into the protected
segment, which holds at most a share of the cached tokens
(``RadixCacheConfig.slru_protected_share``); the least recently hit nodes past that share go
back to probation. ``node.protected`` says which segment a node is in, and the eviction order
takes probation first. The tree keeps one :class:`ProtectedSegment` and requeues each node it
demotes (its sort key changed).
"""

from __future__ import annotations

from collections import OrderedDict

from hicache.radix.node import TreeNode

__all__ = ["ProtectedSegment"]


class ProtectedSegment:
    """The protected nodes of one tree by id, least recently hit first, and their tokens."""

    def __init__(self) -> None:
        self._nodes: OrderedDict[int, TreeNode] = OrderedDict()
        self.tokens = 0

    def promote(self, node: TreeNode, limit: float) -> list[TreeNode]:
        """Make ``node`` (hit now) the most recently hit protected node, then demote the least
        recently hit while the segment holds over ``limit`` tokens; returns those demoted."""
        if node.protected:
            self._nodes.move_to_end(node.id)
            return []
        node.protected = True
        self._nodes[node.id] = node
        self.tokens += node.length
        demoted = []
        while self.tokens > limit and self._nodes:
            _, oldest = self._nodes.popitem(last=False)
            oldest.protected = False
            self.tokens -= oldest.length
            demoted.append(oldest)
        return demoted

    def remove(self, node: TreeNode) -> None:
        """Take ``node`` out of the segment (its device slots went)."""
        node.protected = False
        if self._nodes.pop(node.id, None) is not None:
            self.tokens -= node.length

    def split(self, upper: TreeNode) -> None:
        """A protected node was split: ``upper`` took part of its tokens and is protected too."""
        upper.protected = True
        self._nodes[upper.id] = upper
