"""The tree's extension points: the hooks a subclass of the tree overrides, and the tree
operations it calls.

A tree built on :class:`~hicache.radix.tree.RadixCache` or
:class:`~hicache.radix.shadow.ShadowRadixCache` (the tiered cache,
:class:`~hicache.tiering.cache.HiRadixCache`) changes the tree's behaviour only by overriding
the hooks declared below (calling ``super()`` where it adds to the tree's step rather than
replacing it) and public methods; it builds its own match and insert from the public tree
operations:

==========================  ==================================================================
operation                   what it does
==========================  ==================================================================
``pack_key(key)``           ``key`` packed as the tree compares it: (bytes, bytes a unit)
``namespace_root``          a namespace's root, or None when nothing is cached there
``ensure_root(key)``        ``key``'s namespace root, registered if the namespace had none
``detached_root(key)``      a fresh root for ``key``'s namespace, not registered (a miss)
``walk``                    follow packed data from a root, splitting and touching nodes
``touch_path``              refresh (and count a hit on) nodes a match found on its own
``add_leaf``                hang a new leaf holding device slots, counted and queued
``requeue``                 queue a node for eviction after a change the tree did not see
``release_device_slots``    free a node's device slots; the node stays
``detach_leaf``             unlink a childless node
``cut_path`` (shadow)       the nodes covering a path's first units, the last one split
``remove_leaf`` (shadow)    free every pool's data on a leaf and take it out of the tree
``hang_leaf``, ``split_node``, ``restore_device_slots`` (shadow): see their docstrings
==========================  ==================================================================

Everything else whose name starts with ``_`` is the tree's own: no module outside ``radix/``
uses it (``tests/radix/test_tree_extension_points.py`` checks this). Which fields of a
:class:`~hicache.radix.node.TreeNode` each layer writes is written down on that class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from hicache.keys import RadixKey
    from hicache.radix.node import TreeNode

__all__ = ["ShadowTreeHooks", "TreeHooks"]


class TreeHooks(Protocol):
    """The hooks of :class:`~hicache.radix.tree.RadixCache`."""

    def split_span(self, child: TreeNode, nbytes: int, unit: int) -> TreeNode:
        """Cut ``child`` after ``nbytes`` bytes of its packed span (whole pages); the new upper
        node takes its place and is returned. Every split of the tree goes through here, so an
        override cuts the data it keeps on nodes the same way (after ``super()``)."""
        ...

    def is_evictable_leaf(self, node: TreeNode) -> bool:
        """Whether :meth:`~hicache.radix.tree.RadixCache.evict` may take ``node`` now: it holds
        device slots, nothing locks it, and nothing under it keeps it (asked when the node is
        queued and again when it comes off the eviction heap)."""
        ...

    def evict_leaf(self, node: TreeNode) -> int:
        """Free ``node`` for an eviction (:meth:`is_evictable_leaf` said yes); returns the tokens
        freed, 0 to keep it this time. The plain tree frees its device slots and detaches it."""
        ...


class ShadowTreeHooks(TreeHooks, Protocol):
    """The hooks :class:`~hicache.radix.shadow.ShadowRadixCache` adds."""

    def insert_anchor(self, key: RadixKey, value: torch.Tensor | None, priority: int) -> int:
        """Insert ``key`` with the anchor pool's slots ``value``; the units whose anchor the
        tree held already (the caller frees those of ``value``). Called by ``insert`` and
        ``insert_bundle`` before the other pools' data is attached."""
        ...

    def on_inserted(self, path: list[TreeNode]) -> None:
        """Told the nodes of an inserted key, in path order, once every pool's data is on them
        (the plain shadow tree does nothing; the tiered cache backs them up)."""
        ...

    def drop_pool_data(self, node: TreeNode, name: str) -> int:
        """Free pool ``name``'s device data on ``node`` for ``evict_pool``; returns the slots
        freed. The plain shadow tree also prunes a node left holding nothing."""
        ...
