"""HiRadixCache: the radix tree over three tiers (device, host, L3).

A node is on the device when ``value`` holds its slots, on host when ``host_value`` holds its
host pages (one per token page; a split cuts it at the same page boundary as ``value``), and
known to be in L3 when ``in_storage`` (set from write acknowledgements). Nodes on the device
form the top of the tree: a device node's ancestors are all on the device. A node on neither
device nor host is removed.

Hits: ``hit_count`` counts the requests whose ``match_prefix`` reached a node (a match with
``count_hits=False``, such as the tree's own re-match inside ``cache_unfinished_req``, is not a
hit). Write policies read it:

* ``write_through``: every node is backed up to host when it is inserted;
* ``write_through_selective``: a node is backed up once its hit count reaches the threshold;
* ``write_back``: a node is backed up when the device evicts it.

Backed-up nodes form the top of the tree too (a node is backed up only after its parent), so a
host hit is a prefix. Device eviction frees the anchor pool's slots: a backed-up node stays in
the tree on host, with the other pools' device data where it was (each pool evicts its own with
``evict_pool``, backing it up first); a node whose anchor is on no tier after it (not backed up,
and write_back could not) leaves the tree with every pool's data. Host eviction
(``HostEvictor``) removes leaves whose anchor is on host only, unlocked, not protected by an L3
write in flight and not anchoring a prefetch, freeing any other pool's device data on them.

The cache owns the controller (device <-> host copies, the storage tier) and composes its
parts: backups, host eviction, load-back (``host/``), prefetch insert, the L3 writer and the
prefetcher (``l3/``). It is the only module that knows them all; each part receives only what it
uses, the narrow views of :mod:`~hicache.tiering.common.parts`, which the tree fulfils with
public operations. An engine calls only :class:`~hicache.tiering.contract.TieredCache` (what
only reaches the parts: :class:`~hicache.tiering.contract.TieredCacheOps`). Everything here
runs on the scheduler's thread; :meth:`check_events` applies, once per scheduler step, what
the controller finished meanwhile.

Per-pool lifecycles: the tree is a :class:`~hicache.radix.shadow.ShadowRadixCache`, so a model
with more than one kind of cached state gives each extra pool (an SWA window pool, a Mamba state
pool) its own slots, locks and eviction on the device (``tree.ledger``) and its own host pages
(:mod:`~hicache.tiering.host.pool`). A match is the longest prefix where every pool's hit rule
holds: on the device for ``prefix_len``, on device or host for the host hit that
:meth:`init_load_back` then loads (:mod:`~hicache.tiering.host.load_back`). Backups copy every
pool a node holds (:mod:`~hicache.tiering.host.backup`); L3 stores, per page, the objects of the
pools that hold it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.pools.device import DevicePool
from hicache.pools.host import HostPool
from hicache.pools.pool_spec import ModelPools
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.node import TreeNode
from hicache.radix.shadow import ShadowMatchResult, ShadowRadixCache
from hicache.radix.shadow_rules import peek_path, pool_indices
from hicache.radix.slots import concat_slots
from hicache.radix.tier_peek import TierPeek
from hicache.radix.tree import MatchResult, RadixCacheConfig
from hicache.tiering.common.config import HiCacheConfig
from hicache.tiering.common.metrics import HiCacheMetrics
from hicache.tiering.common.parts import GroupTransfer, TierPools
from hicache.tiering.common.policies import TerminationReason, WritePolicy, backup_on_hit
from hicache.tiering.contract import TieredCache, TieredCacheOps
from hicache.tiering.controller import HiCacheController
from hicache.tiering.host.backup import Backups
from hicache.tiering.host.eviction import HostEvictor
from hicache.tiering.host.load_back import LoadBack
from hicache.tiering.host.peek import tiered_peek
from hicache.tiering.host.pool import ComputedHostPages, hang_host_leaf, split_host
from hicache.tiering.l3.bundler import BundlePage, PageHasher
from hicache.tiering.l3.prefetch_insert import PrefetchInserter
from hicache.tiering.l3.prefetcher import Prefetcher
from hicache.tiering.l3.writer import L3Writer

__all__ = ["HiRadixCache"]


class HiRadixCache(ShadowRadixCache, TieredCacheOps):
    """A :class:`~hicache.radix.RadixCache` whose nodes move between device, host and L3.

    Build one with :meth:`open` (pools and a config; it connects L3) and end it with
    :meth:`close`; :meth:`quiesce` waits until every queued write and running prefetch settled.
    """

    def __init__(
        self,
        controller: HiCacheController,
        config: RadixCacheConfig | None = None,
        req_to_token: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = config or RadixCacheConfig(page_size=controller.page_size)
        if config.page_size != controller.page_size or config.simulated:
            raise ConfigError("the tree's page size must be the pools' and it must hold KV")
        specs = tuple(pool.spec for pool in controller.device_pools.values())
        pools = ModelPools("tiered", controller.page_size, specs)
        owners = {name: controller.device_pools[name] for name in controller.groups}
        super().__init__(pools, owners, config, req_to_token, clock)
        self.controller = controller
        self.tiers = controller.config.tiers
        self.host = controller.anchor_host
        self.device = controller.anchor_device  # the tree's allocator, typed
        self.metrics: HiCacheMetrics = controller.metrics
        self.storage = controller.storage
        self._build_parts(controller, clock)
        self.pending_loads: list[GroupTransfer] = []
        self._kept: list[TreeNode] = []  # leaves an eviction kept (see evict)

    def _build_parts(self, controller: HiCacheController, clock: Callable[[], float]) -> None:
        """The parts, each given only what it uses (see :mod:`hicache.tiering.common.parts`)."""
        config, tiers = controller.config, self.tiers
        owner_hosts = {name: controller.host_pools[name] for name in controller.groups}
        pools = TierPools(self.roles, self.page_size, controller.groups, owner_hosts)
        hasher = PageHasher(config.storage.model_id, self.page_size, list(controller.host_pools))
        self.writer = L3Writer(pools, self.storage, hasher, config.storage)
        self.host_evictor = HostEvictor(self, pools, self.metrics)
        self.inserter = PrefetchInserter(self, pools)
        self.prefetcher = Prefetcher(
            self.inserter, self.host_evictor, self.storage, hasher, config.prefetch, clock
        )
        self.backups = Backups(
            self, pools, controller, self.host_evictor, self.writer, tiers.host_enabled
        )
        anchors = self.host_evictor.anchors
        threshold = tiers.load_back_threshold_tokens
        self.loader = LoadBack(self, pools, controller, anchors, self.metrics, threshold)

    # ----- lifecycle ------------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        config: HiCacheConfig,
        device_pools: Mapping[str, DevicePool],
        host_pools: Mapping[str, HostPool],
        radix: RadixCacheConfig | None = None,
    ) -> HiRadixCache:
        """A tiered cache over ``device_pools`` and ``host_pools`` (one pool group), with its L3
        connected when ``config.storage.url`` is set (see :meth:`HiCacheController.open`)."""
        controller = await HiCacheController.open(config, device_pools, host_pools)
        return cls(controller, radix)

    async def close(self, drain_s: float = 0.0) -> None:
        """Apply finished work, give queued L3 writes up to ``drain_s`` to land, close L3 (its
        pages deleted first where the namespaces are scratch: ``storage.discard_on_close``)."""
        self.check_events()
        await self.controller.close(drain_s, self._discarded_tags())

    async def detach_l3(self, drain_s: float = 10.0) -> bool:
        """Stop using L3 at run time (queued writes get ``drain_s``); whether one was attached.
        No node counts as stored any more: a host copy is never dropped for an L3 copy that
        this cache no longer reaches."""
        if self.storage.backend is None:
            return False
        await self.controller.close(drain_s, self._discarded_tags())
        self.check_events()
        for node in self.all_nodes():
            node.in_storage = False
            node.pool_stored = frozenset()
        return True

    def _discarded_tags(self) -> frozenset[str]:
        """The namespaces whose L3 pages go at close: every one this cache keyed pages in,
        when they are scratch."""
        if not self.controller.config.storage.discard_on_close:
            return frozenset()
        return self.writer.hasher.namespace_tags()

    async def quiesce(self, timeout_s: float = 60.0) -> None:
        """Wait until every queued write and running prefetch has settled, applying results.

        Running prefetches are waited for whatever their stop policy (nothing schedules them
        here). Raises TimeoutError after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_events()
            if self.idle:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the tiered cache did not settle in {timeout_s} s")
            # Device-to-host copies complete on their own stream (no asyncio wake-up): poll
            # them briefly; everything else wakes this wait when it finishes.
            busy_copying = bool(self.backups.in_flight)
            await self.storage.wait_for_activity(min(left, 0.001) if busy_copying else left)

    # ----- matching -------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey, count_hits: bool = True) -> ShadowMatchResult:
        """The device hit, then the host hit after it (``last_host_node``, ``host_hit_length``):
        each the longest prefix where every pool's hit rule holds on that tier.

        ``count_hits=False`` counts no hit and triggers no write policy: for deciding about a
        request before it is scheduled, and for the tree's own re-matches.
        """
        data, unit = self.pack_key(key)
        root = self.namespace_root(key.extra_key, key.is_bigram)
        if root is None:
            root = self.detached_root(key)
            empty = ShadowMatchResult(0, root, concat_slots([]), root, 0)
            empty.pool_indices = pool_indices(self.roles, [], empty.device_indices)
            return empty
        path, device = self._tiered_path(root, data, unit)
        self.touch_path(path, count_hits)
        on_device = path[:device]
        last_device = on_device[-1] if on_device else root
        indices = concat_slots([n.value for n in on_device])
        matched = sum(n.length for n in on_device)
        result = ShadowMatchResult(matched, last_device, indices, path=on_device)
        result.pool_indices = pool_indices(self.roles, on_device, indices)
        result.last_host_node = path[-1] if path else last_device
        result.host_hit_length = sum(n.length for n in path[device:])
        if count_hits:
            self.metrics.add("device_hit_tokens", result.prefix_len)
            self._backup_on_hits(path)
            self.writer.admit_hits(path)
        return result

    def peek_tiers(self, key: RadixKey) -> TierPeek:
        """What :meth:`match_prefix` would find, in device and host units, without touching
        the tree (see :mod:`~hicache.tiering.host.peek`)."""
        data, unit = self.pack_key(key)
        root = self.namespace_root(key.extra_key, key.is_bigram)
        return tiered_peek(self.roles, self.page_size, root, data, unit)

    def _tiered_path(self, root: TreeNode, data: bytes, unit: int) -> tuple[list[TreeNode], int]:
        """The nodes of the prefix usable on device or host (:func:`tiered_peek`'s lengths),
        split at its end and at the device-usable end; and how many of them are the device
        part."""
        peek = tiered_peek(self.roles, self.page_size, root, data, unit)
        usable, span = data[: peek.total * unit], self.page_size * unit
        for units in (peek.total, peek.device):  # a split changes no page's presence
            self.cut_path(peek_path(root, usable, span)[0], units, unit)
        path, _ = peek_path(root, usable, span)
        depth, count = 0, 0
        for node in path:
            depth += node.length
            if depth > peek.device:
                break
            count += 1
        return path, count

    def _backup_on_hits(self, path: list[TreeNode]) -> None:
        policy, threshold = self.tiers.write_policy, self.tiers.write_threshold
        for node in path if policy is WritePolicy.WRITE_THROUGH_SELECTIVE else ():
            if node.value is None or node.host_value is not None:
                continue
            if not backup_on_hit(policy, node.hit_count, threshold) or not self._backup(node):
                break  # backed-up nodes stay a prefix of the tree

    def match_anchor(self, key: RadixKey) -> MatchResult:
        """The anchor's device path for ``key`` whatever the other pools hold, counting no hit:
        for the request lifecycle's re-match after it committed a key."""
        data, unit = self.pack_key(key)
        root = self.namespace_root(key.extra_key, key.is_bigram)
        if root is None:
            return MatchResult(0, self.detached_root(key), concat_slots([]))
        _, _, path = self.walk(root, data, unit, hit=False)
        device = []
        for node in path:
            if node.value is None:
                break
            device.append(node)
        last = device[-1] if device else root
        indices = concat_slots([n.value for n in device])
        return MatchResult(len(indices), last, indices, path=device)

    # ----- inserting ------------------------------------------------------------------------
    def insert_anchor(self, key: RadixKey, value: Any, priority: int) -> int:
        """Cache ``key`` with device slots ``value``; returns the units already on the device.

        Nodes on the path that are on host only take the matching part of ``value`` (they are
        on the device again); the caller frees only ``value[:returned]`` beyond its own prefix.
        Reached through :meth:`insert` and :meth:`insert_bundle`.
        """
        data, unit = self.pack_key(key)
        n_units = len(data) // unit
        if value is None or len(value) != len(key) or len(value) < n_units:
            raise InvalidArgumentError(f"insert of {len(key)} units needs as many device slots")
        if not data:
            return 0
        node, pos, path = self.walk(self.ensure_root(key), data, unit, hit=False, priority=priority)
        on_device, offset = 0, 0
        for n in path:
            if n.value is None:  # on host only: the request recomputed it, adopt its slots
                self.restore_device_slots(n, value[offset : offset + n.length])
                self.requeue(n)
            elif offset == on_device:
                on_device += n.length
            offset += n.length
        if pos < len(data):
            self.add_leaf(node, data[pos:], value[pos // unit : n_units], priority)
        return on_device

    def on_inserted(self, path: list[TreeNode]) -> None:
        """Write-through: back up every node of an inserted key, every pool it holds."""
        if self.tiers.write_policy is WritePolicy.WRITE_THROUGH:
            for n in path:
                if not self._backup(n):
                    break

    def insert_prefetched(
        self, key: RadixKey, start: int, bundle: list[BundlePage]
    ) -> tuple[int, TreeNode | None]:
        """Hang prefetched pages (``bundle``: their host pages per pool) under the tree as
        host-only nodes; free any duplicates. Returns how many pages were inserted (the rest
        was there already, or had no parent) and the node the prefix now ends at (None when
        its parent was gone). See :class:`~hicache.tiering.l3.prefetch_insert.PrefetchInserter`."""
        return self.inserter.insert(key, start, bundle)

    def insert_host_pages(self, computed: ComputedHostPages) -> int:
        """See :meth:`TieredCache.insert_host_pages`."""
        taken, nodes = hang_host_leaf(self, self.host_evictor.pools, computed)
        for node in nodes:
            self.writer.after_backup(node)
        return taken

    # ----- device -> host -------------------------------------------------------------------
    def _backup(self, node: TreeNode, evicting: bool = False) -> bool:
        """Copy ``node``'s data that host lacks (every pool); whether its anchor is on host or
        on its way (see :class:`~hicache.tiering.host.backup.Backups`)."""
        return self.backups.backup(node, evicting)

    # ----- host -> device -------------------------------------------------------------------
    def init_load_back(self, node: TreeNode, mem_quota: int | None = None) -> tuple[Any, TreeNode]:
        """Load what the prefix ending at ``node`` lacks on the device from host, every pool by
        its hit rule (the anchor's host-only ancestors; an SWA window; a state snapshot).

        Returns (device slots of the anchor span loaded, the node the device prefix now ends
        at). All or nothing; nothing is loaded when the anchor span is under the load-back
        threshold or over ``mem_quota``, or device slots cannot be freed for it.
        """
        slots, end, transfer = self.loader.load(node, mem_quota)
        if transfer is not None:
            self.pending_loads.append(transfer)
        return slots, end

    def ready_to_load_host_cache(self) -> list[GroupTransfer]:
        """The loads started since the last call: a forward pass waits on them per layer."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    # ----- device eviction ------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """:meth:`RadixCache.evict`; a leaf kept this time (its backup found no host pages) goes
        back on the eviction heap afterwards, so a later eviction finds it again."""
        self._kept = []
        try:
            return super().evict(num_tokens)
        finally:
            kept, self._kept = self._kept, []
            for node in kept:
                self.requeue(node)

    def is_evictable_leaf(self, node: TreeNode) -> bool:
        if node.lock_ref > 0 or node.value is None or node.parent is None or not node.key:
            return False
        if self.ledger.is_locked(node):
            return False
        return all(child.value is None for child in node.children.values())

    def evict_leaf(self, node: TreeNode) -> int:
        # Backed up now: under write_back always; under write-through when its backup at insert
        # or hit could not get host pages then (host full of pages in flight to L3); always when
        # it has host-only children that need their parent.
        policy, threshold = self.tiers.write_policy, self.tiers.write_threshold
        needs_backup = node.host_value is None and (
            policy is WritePolicy.WRITE_BACK
            or bool(node.children)
            or backup_on_hit(policy, node.hit_count, threshold)
        )
        if needs_backup and not self._backup(node, evicting=True) and node.children:
            self._kept.append(node)  # its host-only children would lose their parent: not now
            return 0
        self.metrics.add("device_evicted_tokens", node.length)
        if node.host_value is None:
            return self.remove_leaf(node)  # on no tier: out of the tree, every pool freed
        # Backed up: free the anchor's device slots only; the node stays in the tree, on host.
        # The other pools keep their device data until their own evict_pool (a copy to host
        # now, where it can be had, spares that eviction the copy).
        self._backup(node, evicting=True)
        self.release_device_slots(node)
        assert node.parent is not None  # an evictable leaf hangs under a parent
        self.requeue(node.parent)
        return node.length

    def drop_pool_data(self, node: TreeNode, name: str) -> int:
        """Per-pool device eviction: a node on host keeps the pool's data there (copied now if
        it was not); the device slots are freed."""
        if node.host_value is not None:
            self._backup(node, evicting=True)
        return self.ledger.drop(node, name)

    def split_span(self, child: TreeNode, nbytes: int, unit: int) -> TreeNode:
        upper = super().split_span(child, nbytes, unit)
        split_host(self.roles, child, upper, upper.length // self.page_size)
        return upper

    # ----- requests -------------------------------------------------------------------------
    def release_request(self, req: CachedRequest) -> None:
        """An aborted request: stop its prefetch, free its own slots and row, drop its lock."""
        self.prefetcher.terminate(req.rid, TerminationReason.ABORTED)
        if self.req_to_token is not None and req.allocated:
            row = self.req_to_token.table[req.req_pool_idx]
            own = row[len(req.prefix_indices) : req.allocated].clone()
            if len(own):
                self.device.free(own)
            self.req_to_token.free(req.req_pool_idx)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = None
        req.allocated = 0

    def reset(self) -> None:
        raise InvalidArgumentError("a HiRadixCache is not reset in place; build a new one")


if TYPE_CHECKING:  # mypy checks that the cache is what the engine is told it is
    _declared: type[TieredCache] = HiRadixCache
