"""ShadowRadixCache: one prefix tree over the pools of a model ("one tree, many pools").

The tree indexes full token positions once. Each node maps onto every pool:

* the **anchor** pool (the model's first per-token ALL_PAGES owner pool: ``kv``, ``latent``,
  dsv4's ``c4``) is the tree's ``value``, as in :class:`~hicache.radix.tree.RadixCache`.
  ``evict`` frees the anchor's slots of leaves, and of nodes whose children's anchor went
  before; such a node stays in the tree, anchor-less (``value`` None), while another pool holds
  data on it or a child hangs under it, and leaves once neither is true. Eviction in one pool
  never frees another's slots. The anchor's nodes stay the top of the tree: a recomputed prefix
  gives its anchor-less nodes the caller's slots again (:meth:`insert_bundle`).
* every other owner pool keeps its data in ``node.pool_values[name]``: a per-token pool (SWA,
  dsv4's ``c128``) the slots of the node's span, a per-sequence pool (conv/SSM state) the slot
  of a snapshot taken at the node's end; ``None`` once that pool dropped it. A pool drops data
  a **whole node** at a time (``evict_pool``), so a tree-wide span shared by many requests is
  kept or dropped as one; an insert cuts a new span where held-ness changes, so a caller's
  window lands on its own nodes.
* sidecars (``shares_slots_with``: the DSA indexer, the SSM state) hold nothing: their owner's
  slots address them, so they are kept, matched and freed with their owner.

A match is usable up to the longest prefix for which every pool's hit rule holds
(:func:`~hicache.pools.pool_spec.common_usable_prefix`): an SWA prefix needs its window's pages, a
hybrid prefix ends at a node end with a snapshot, a dsv4 prefix needs ``c4`` (with its indexer)
and ``c128`` on every page and ``swa`` on its window's (the seed's ShadowRadix: SWA keeps the
last 128 raw tokens, C4 is searched top-k over every entry, C128 attended densely). The match
splits a node when that end falls inside it, counts hits only on the usable part, and returns
each pool's slots.

The tree keeps the structure (match, insert, split, evict); the extra pools' data, their locks
and every pool's sizes are kept by its :class:`~hicache.radix.pool_ledger.PoolLedger`
(``tree.ledger``), which the tree calls when a node gains, loses or splits data.

Two counters lock: the tree lock (``inc_lock_ref``) keeps nodes and anchor data; a pool lock
(``tree.ledger.lock``) keeps one pool's data on the nodes of a path that the pool needs (an SWA
window's nodes, a state's end node, the whole path otherwise). Neither reaches into another
pool: ``evict_pool`` frees a pool's data on nodes that pool has not locked, whatever the tree
lock says; ``evict`` frees the anchor of nodes the tree lock does not hold, whatever the pool
locks say (a pool-locked node stays in the tree with its data).

Sizes per pool (``tree.ledger.size``, ``evictable``, ``protected``) count slots (tokens for a
per-token pool, snapshots for a per-sequence one) and are kept exact; "protected" means a lock
holds the data. ``evict_pool`` scans the tree (LRU, shallow nodes first on ties): it is
O(nodes log nodes), unlike the anchor's lazy heap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.pools.pool_spec import ModelPools, common_usable_prefix
from hicache.radix.node import TreeNode
from hicache.radix.packing import unit_bytes
from hicache.radix.pool_ledger import PoolLedger
from hicache.radix.shadow_rules import (
    check_pool_values,
    holds_nothing,
    path_presence,
    peek_path,
    pool_indices,
    pool_roles,
)
from hicache.radix.slots import SlotAllocator, concat_slots
from hicache.radix.tier_peek import TierPeek
from hicache.radix.tree import MatchResult, RadixCache, RadixCacheConfig

if TYPE_CHECKING:
    from hicache.pools.req_to_token import ReqToTokenPool
    from hicache.radix.hooks import ShadowTreeHooks

__all__ = ["ShadowInsertResult", "ShadowMatchResult", "ShadowRadixCache"]


@dataclass(slots=True)
class ShadowMatchResult(MatchResult):
    """A match over every pool. ``pool_indices`` holds, per non-anchor pool, the prefix's slots
    (per-token: ``prefix_len`` slots, -1 where the pool holds nothing; per-sequence: the snapshot
    slot at the prefix end as a 1-element tensor, or None for an empty prefix)."""

    pool_indices: dict[str, torch.Tensor | None] = field(default_factory=dict)


@dataclass(slots=True)
class ShadowInsertResult:
    """``already``: units the anchor already held (as :meth:`RadixCache.insert` returns).
    ``unused``: per extra pool, the slots passed in that the tree did not keep; the caller
    frees them."""

    already: int
    unused: dict[str, torch.Tensor]


class ShadowRadixCache(RadixCache):
    """A radix tree whose nodes map onto every pool of ``pools``; ``ledger`` holds the extra
    pools' per-node data and locks, and every pool's sizes.

    Extension points (:mod:`hicache.radix.hooks`): besides RadixCache's hooks, a subclass
    overrides :meth:`insert_anchor`, :meth:`on_inserted` and :meth:`drop_pool_data`; it adds
    :meth:`cut_path`, :meth:`remove_leaf`, :meth:`hang_leaf`, :meth:`split_node` and
    :meth:`restore_device_slots` to the public tree operations.
    """

    def __init__(
        self,
        pools: ModelPools,
        allocators: Mapping[str, SlotAllocator],
        config: RadixCacheConfig | None = None,
        req_to_token: ReqToTokenPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        roles = pool_roles(pools)
        config = config or RadixCacheConfig(page_size=pools.page_size)
        if config.page_size != pools.page_size or config.simulated:
            raise ConfigError("a shadow tree holds real slots, in pages of the model's page_size")
        owners = {roles.anchor, *roles.extra}
        if not isinstance(allocators, Mapping) or set(allocators) != owners:
            got = sorted(allocators) if isinstance(allocators, Mapping) else allocators
            raise ConfigError(f"allocators are needed for exactly {sorted(owners)}, got {got}")
        super().__init__(config, allocators[roles.anchor], req_to_token, clock)
        self.pools = pools
        self.roles = roles
        self.allocators = dict(allocators)
        self.ledger = PoolLedger(roles, allocators, self.page_size, self, self._prune)

    # ----- matching -------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey, count_hits: bool = True) -> ShadowMatchResult:
        """The longest prefix of ``key`` that every pool can serve; see the module docstring.

        Only the usable nodes are touched (hit, access time), so a node the match reaches but
        cannot use ages as if unmatched.
        """
        unit, path, usable = self._usable(key)
        root = self._roots.get((key.extra_key, key.is_bigram))
        if root is None:
            empty = torch.empty(0, dtype=torch.int64)
            result = ShadowMatchResult(0, self.detached_root(key), empty)
            result.pool_indices = pool_indices(self.roles, [], empty)
            return result
        path = self.cut_path(path, usable, unit)
        self.touch_path(path, count_hits)
        last = path[-1] if path else root
        indices = concat_slots([n.value for n in path])
        result = ShadowMatchResult(usable, last, indices, path=path)
        result.pool_indices = pool_indices(self.roles, path, indices)
        return result

    def peek_prefix(self, key: RadixKey) -> tuple[int, TreeNode | None]:
        """Like :meth:`RadixCache.peek_prefix`, but only as far as every hit rule holds."""
        _, path, usable = self._usable(key)
        depth = 0
        for node in path:
            depth += node.length
            if usable and depth >= usable:
                return usable, node
        return 0, None

    def peek_tiers(self, key: RadixKey) -> TierPeek:
        """:meth:`peek_prefix` as a :class:`TierPeek`: this tree holds the device tier only
        (the tiered cache adds its host hit)."""
        usable, node = self.peek_prefix(key)
        return TierPeek(usable, 0, node, node)

    def _usable(self, key: RadixKey) -> tuple[int, list[TreeNode], int]:
        """(bytes a unit, the nodes ``key`` reaches without touching the tree, usable units)."""
        data, unit = self.pack_key(key)
        root = self._roots.get((key.extra_key, key.is_bigram))
        path, last_bytes = peek_path(root, data, self.page_size * unit)
        presence = path_presence(self.roles, path, self.page_size, last_bytes // unit)
        return unit, path, common_usable_prefix(presence) * self.page_size

    def cut_path(self, path: list[TreeNode], units: int, unit: int) -> list[TreeNode]:
        """The nodes of ``path`` (a path from a namespace root, as a peek finds it) covering its
        first ``units`` units (whole pages), splitting the node that end falls inside."""
        depth = 0
        for i, node in enumerate(path):
            if depth + node.length <= units:
                depth += node.length
                continue
            if depth == units:
                return path[:i]
            return [*path[:i], self.split_span(node, (units - depth) * unit, unit)]
        return path

    # ----- the anchor's own path -------------------------------------------------------------
    def match_anchor(self, key: RadixKey) -> MatchResult:
        """The anchor's cached path for ``key`` whatever the other pools hold, counting no hit
        (:meth:`RadixCache.match_prefix` with ``count_hits=False``): for the request
        lifecycle's re-match after it committed a key, where a match cut at the usable prefix
        would leave the request's row pointing at its own freed duplicates."""
        return RadixCache.match_prefix(self, key, count_hits=False)

    # ----- inserting ------------------------------------------------------------------------
    def insert(self, key: RadixKey, value: torch.Tensor | None = None, priority: int = 0) -> int:
        """Cache ``key`` with anchor slots only; the other pools hold nothing on new nodes."""
        return self.insert_bundle(key, value, None, priority).already

    def insert_bundle(
        self,
        key: RadixKey,
        value: torch.Tensor | None,
        pool_values: Mapping[str, object] | None,
        priority: int = 0,
    ) -> ShadowInsertResult:
        """Cache ``key`` with its anchor slots ``value`` and each extra pool's slots.

        A per-token pool passes ``len(key)`` slots, -1 for tokens it does not hold (whole pages);
        a per-sequence pool the slot of the snapshot at the key's end (page-aligned keys only).
        Nodes that already hold a pool's data keep theirs; a node the pool had dropped takes the
        caller's slots when they cover its whole span. Everything is checked before any change.
        """
        data, unit = self.pack_key(key)
        given = check_pool_values(self.roles, pool_values, len(key), self.page_size)
        already = self.insert_anchor(key, value, priority)
        n_units = len(key) - len(key) % self.page_size
        unused: dict[str, list[torch.Tensor]] = {name: [] for name in given}
        if n_units:
            root = self._roots[(key.extra_key, key.is_bigram)]
            path, _ = peek_path(root, data, self.page_size * unit)
            path = self._cut_path_by_held(path, given, unit)
            self._attach(path, given, unused)
            self.on_inserted(path)
        for name, slots in given.items():
            if name in self.roles.token_pools:
                tail = slots[n_units:]
                unused[name].append(tail[tail >= 0])
            elif not n_units:
                unused[name].append(slots)
        empty = torch.empty(0, dtype=torch.int64)
        return ShadowInsertResult(
            already, {n: concat_slots(p) if p else empty for n, p in unused.items()}
        )

    def insert_anchor(self, key: RadixKey, value: torch.Tensor | None, priority: int) -> int:
        """Hook: insert the anchor's slots; returns the units whose anchor the tree held
        already. Anchor-less nodes on the path (their anchor was evicted) take the caller's
        slots: the caller computed them again. The tiered cache adds its tiers here."""
        matched = RadixCache.insert(self, key, value, priority)
        if not matched or value is None:
            return matched
        data, unit = self.pack_key(key)
        root = self._roots[(key.extra_key, key.is_bigram)]
        path, _ = peek_path(root, data[: matched * unit], self.page_size * unit)
        held, offset = matched, 0
        for node in path:  # the insert's walk split the last one at the key's end
            if node.value is None:
                held = min(held, offset)
                self.restore_device_slots(node, value[offset : offset + node.length])
                self.requeue(node)
            offset += node.length
        return held

    def on_inserted(self, path: list[TreeNode]) -> None:
        """Hook: called with the nodes of an inserted key once every pool's data is on them."""

    def _cut_path_by_held(
        self, path: list[TreeNode], given: dict[str, torch.Tensor], unit: int
    ) -> list[TreeNode]:
        """``path`` with each node split where the caller's held-ness of a token pool changes
        inside it, for the pools the node holds nothing of: a caller's window then lands on
        nodes of its own, new or old."""
        out: list[TreeNode] = []
        depth = 0
        for node in path:
            start = depth
            depth += node.length
            out += self._cut_by_held(node, given, start, unit)
        return out

    def _cut_by_held(
        self, leaf: TreeNode, given: dict[str, torch.Tensor], start: int, unit: int
    ) -> list[TreeNode]:
        """Split ``leaf`` (units ``start..``) where a token pool it lacks changes held-ness."""
        ps = self.page_size
        end = start + leaf.length
        cuts: set[int] = set()
        for name, slots in given.items():
            if name in self.roles.token_pools and self.ledger.data(leaf, name) is None:
                held = (slots[start:end:ps] >= 0).tolist()
                cuts.update(start + i * ps for i in range(1, len(held)) if held[i] != held[i - 1])
        nodes, seg_start = [], start
        for cut in sorted(cuts):
            nodes.append(self.split_span(leaf, (cut - seg_start) * unit, unit))
            seg_start = cut
        return [*nodes, leaf]

    def _attach(
        self,
        path: list[TreeNode],
        given: dict[str, torch.Tensor],
        unused: dict[str, list[torch.Tensor]],
    ) -> None:
        """Give each node of ``path`` (the inserted key's) the caller's slots of every pool
        that holds nothing there; slots a node does not take go to ``unused``."""
        ledger, depth = self.ledger, 0
        for node in path:
            for name in self.roles.token_pools:
                if name not in given:
                    continue
                piece = given[name][depth : depth + node.length]
                if ledger.data(node, name) is None and bool((piece >= 0).all()):
                    ledger.put(node, name, piece.clone())
                else:
                    unused[name].append(piece[piece >= 0])
            depth += node.length
        for name in self.roles.state_pools:
            if name in given:
                if ledger.data(path[-1], name) is None:
                    ledger.put(path[-1], name, given[name].clone())
                else:
                    unused[name].append(given[name])

    # ----- steps for the tiers below the device (the tiered cache) --------------------------
    def hang_leaf(self, key: RadixKey, after: int) -> tuple[TreeNode, int, TreeNode | None]:
        """Extend ``key``'s cached path with a new, empty leaf: for pages another tier holds.

        Walks the path of ``key``'s whole pages as :meth:`insert` does (splitting the node the
        key leaves inside, refreshing access times, counting no hit, registering the namespace's
        root). When the path covers at least ``after`` units but not all of them, the rest hangs
        under its last node as a new leaf that holds no slots on any tier: the caller gives it
        its data. Returns (the path's last node, the units it covers, the new leaf or None).
        """
        data, unit = self.pack_key(key)
        node, pos, _ = self.walk(self.ensure_root(key), data, unit, hit=False)
        if pos // unit < after or pos == len(data):
            return node, pos // unit, None
        leaf = self._new_node(node, data[pos:])
        return node, pos // unit, leaf

    def split_node(self, node: TreeNode, units: int) -> TreeNode:
        """Cut ``node`` after its first ``units`` units (whole pages, fewer than it holds): a new
        upper node takes its place with that part of every tier's data, and is returned."""
        if node.parent is None or not 0 < units < node.length or units % self.page_size:
            raise InvalidArgumentError(f"cannot split {node!r} after {units} units")
        unit = unit_bytes(node.namespace[1])
        return self.split_span(node, units * unit, unit)

    def restore_device_slots(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give ``node``, whose data is on another tier only, the device slots ``slots`` that
        data is (being) copied into; they count as evictable. The caller queues the node
        (:meth:`requeue`) once the rest of its path has its slots too."""
        if node.value is not None or len(slots) != node.length:
            raise InvalidArgumentError(f"{node!r} cannot take {len(slots)} device slots")
        node.value = slots
        self.evictable_size += node.length

    # ----- pool eviction --------------------------------------------------------------------
    def evict_pool(self, pool: str, num_slots: int) -> int:
        """Free at least ``num_slots`` of ``pool``'s slots, least recently used nodes first,
        from nodes that pool has not locked; no node is removed and no other pool is touched.
        Returns the slots freed (whole nodes, so possibly more than asked)."""
        name = self.roles.extra_owner(pool)
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise InvalidArgumentError(f"evict_pool needs a non-negative int, got {num_slots!r}")
        ledger = self.ledger
        candidates = [
            n
            for n in self.all_nodes()
            if ledger.data(n, name) is not None and not ledger.lock_ref(n, name)
        ]
        candidates.sort(key=lambda n: (n.last_access_time, n.access_tick, len(n.path_to_root())))
        freed = 0
        for node in candidates:
            if freed >= num_slots:
                break
            freed += self.drop_pool_data(node, name)
        return freed

    def drop_pool_data(self, node: TreeNode, name: str) -> int:
        """Hook: free ``name``'s data on ``node`` for :meth:`evict_pool`; an anchor-less node
        left holding nothing leaves the tree (the tiered cache backs the data up first instead)."""
        freed = self.ledger.drop(node, name)
        self._prune(node)
        return freed

    def _prune(self, node: TreeNode) -> None:
        """Remove ``node`` and then its ancestors while each is an unlocked leaf that holds
        nothing on any tier; queue the last node looked at for eviction (it may have become an
        evictable leaf: a pool lock let go of it, or its last child left)."""
        while node.parent is not None and node.key and holds_nothing(node):
            parent = node.parent
            self.detach_leaf(node)
            node = parent
        if node.parent is not None:
            self.requeue(node)

    # ----- RadixCache's hooks (see hicache.radix.hooks) ---------------------------------------
    def split_span(self, child: TreeNode, nbytes: int, unit: int) -> TreeNode:
        """Split as RadixCache does; the ledger cuts the pools' data and locks the same way."""
        upper = super().split_span(child, nbytes, unit)
        self.ledger.split(child, upper)
        return upper

    def is_evictable_leaf(self, node: TreeNode) -> bool:
        """Whether ``evict`` may free ``node``'s anchor: it holds it, the tree lock does not
        (pool locks keep their own pool's data only), and no child holds it (the anchor's nodes
        stay the top of the tree)."""
        if node.lock_ref > 0 or node.value is None or node.parent is None or not node.key:
            return False
        return all(child.value is None for child in node.children.values())

    def evict_leaf(self, node: TreeNode) -> int:
        """Free ``node``'s anchor slots; the node stays, anchor-less, while another pool holds
        data or a lock on it or a child hangs under it (see the module docstring)."""
        ledger = self.ledger
        if not node.children and not ledger.holds_any(node) and not ledger.is_locked(node):
            return self.remove_leaf(node)
        self.release_device_slots(node)
        parent = node.parent
        assert parent is not None  # an evictable node hangs under a parent
        self.requeue(parent)
        return node.length

    def remove_leaf(self, node: TreeNode) -> int:
        """Free every pool's data on the leaf ``node`` and take it out of the tree; returns its
        units (as :meth:`evict_leaf` does)."""
        self.ledger.drop_all(node)
        return RadixCache.evict_leaf(self, node)

    def reset(self) -> None:
        nodes = self.all_nodes()
        self.ledger.clear(nodes)  # frees the extra pools' slots
        for node in nodes:
            if node.value is not None:
                self.allocators[self.roles.anchor].free(node.value)  # the tree's own allocator
                node.value = None
        RadixCache.__init__(self, self.config, self.allocator, self.req_to_token, self._clock)


if TYPE_CHECKING:  # mypy checks that the tree has the hooks it declares
    _hooks: type[ShadowTreeHooks] = ShadowRadixCache
