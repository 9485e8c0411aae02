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
host hit is a prefix. Device eviction keeps a backed-up node on host and drops one that is not
(write_back backs it up first). Host eviction (``HostEvictor``) removes leaves that are on
host only, unlocked, not protected by an L3 write in flight and not anchoring a prefetch.

The cache owns its parts: the controller (device <-> host copies, the storage tier), the
:class:`~hicache.tiering.l3_writer.L3Writer` and the :class:`~hicache.tiering.prefetcher.
Prefetcher`. Everything here runs on the scheduler's thread; :meth:`check_events` applies, once
per scheduler step, what the controller finished meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.pools.device import DevicePool
from hicache.pools.host import HostPool
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.node import TreeNode
from hicache.radix.tree import MatchResult, RadixCache, RadixCacheConfig
from hicache.tiering.bundler import BundlePage, PageHasher
from hicache.tiering.config import HiCacheConfig
from hicache.tiering.controller import GroupTransfer, HiCacheController
from hicache.tiering.host_eviction import HostEvictor
from hicache.tiering.l3_writer import L3Writer
from hicache.tiering.metrics import HiCacheMetrics
from hicache.tiering.policies import TerminationReason, WritePolicy, backup_on_hit
from hicache.tiering.prefetcher import Prefetcher

__all__ = ["HiRadixCache"]


class HiRadixCache(RadixCache):
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
        super().__init__(config, controller.anchor_device, req_to_token, clock)
        self.controller = controller
        self.tiers = controller.config.tiers
        self.host = controller.anchor_host
        self.device = controller.anchor_device  # the tree's allocator, typed
        self.metrics: HiCacheMetrics = controller.metrics
        self.storage = controller.storage
        hasher = PageHasher(
            controller.config.storage.model_id, self.page_size, list(controller.host_pools)
        )
        self.writer = L3Writer(self.storage, self.host, hasher, controller.config.storage)
        self.host_evictor = HostEvictor(self, self.host, self.metrics)
        self.prefetcher = Prefetcher(
            self, self.host_evictor, self.storage, hasher, controller.config.prefetch, clock
        )
        self._pending_writes: list[tuple[GroupTransfer, TreeNode]] = []
        self._pending_loads: list[GroupTransfer] = []
        self._kept: list[TreeNode] = []  # leaves an eviction kept (see evict)

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
        """Apply finished work, give queued L3 writes up to ``drain_s`` to land, close L3."""
        self.check_events()
        await self.controller.close(drain_s)

    @property
    def idle(self) -> bool:
        """Nothing in flight: no copy to host, L3 write or prefetch unsettled."""
        return not (self._pending_writes or self.prefetcher.running or self.storage.busy)

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
            await self.storage.wait_for_activity(min(left, 0.001) if self._pending_writes else left)

    # ----- matching -------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey, count_hits: bool = True) -> MatchResult:
        """The device hit, then the host hit after it (``last_host_node``, ``host_hit_length``).

        ``count_hits=False`` counts no hit and triggers no write policy: for deciding about a
        request before it is scheduled, and for the tree's own re-matches.
        """
        data, unit = self._pack(key)
        root = self._roots.get((key.extra_key, key.is_bigram))
        if root is None:
            root = self._make_root(key)
            return MatchResult(0, root, self._concat([]), root, 0)
        _, _, path = self._walk(root, data, unit, hit=count_hits)
        n_device = 0
        while n_device < len(path) and path[n_device].value is not None:
            n_device += 1
        device, host = path[:n_device], path[n_device:]
        last_device = device[-1] if device else root
        result = MatchResult(sum(n.length for n in device), last_device, path=device)
        result.device_indices = self._concat([n.value for n in device])
        result.last_host_node = host[-1] if host else last_device
        result.host_hit_length = sum(n.length for n in host)
        if count_hits:
            self.metrics.add("device_hit_tokens", result.prefix_len)
            policy, threshold = self.tiers.write_policy, self.tiers.write_threshold
            for node in path if policy is WritePolicy.WRITE_THROUGH_SELECTIVE else ():
                if node.value is None or node.host_value is not None:
                    continue
                if not backup_on_hit(policy, node.hit_count, threshold) or not self._backup(node):
                    break  # backed-up nodes stay a prefix of the tree
            self.writer.admit_hits(path)
        return result

    # ----- inserting ------------------------------------------------------------------------
    def insert(self, key: RadixKey, value: Any = None, priority: int = 0) -> int:
        """Cache ``key`` with device slots ``value``; returns the units already on the device.

        Nodes on the path that are on host only take the matching part of ``value`` (they are
        on the device again); the caller frees only ``value[:returned]`` beyond its own prefix.
        """
        data, unit = self._pack(key)
        n_units = len(data) // unit
        if value is None or len(value) != len(key) or len(value) < n_units:
            raise InvalidArgumentError(f"insert of {len(key)} units needs as many device slots")
        if not data:
            return 0
        root = self._roots.get((key.extra_key, key.is_bigram))
        if root is None:
            root = self._roots[(key.extra_key, key.is_bigram)] = self._make_root(key)
        node, pos, path = self._walk(root, data, unit, hit=False, priority=priority)
        on_device, offset = 0, 0
        for n in path:
            if n.value is None:  # on host only: the request recomputed it, adopt its slots
                n.value = value[offset : offset + n.length]
                self.evictable_size += n.length
                if self._is_evictable_leaf(n):
                    self._push(n)
            elif offset == on_device:
                on_device += n.length
            offset += n.length
        if pos < len(data):
            leaf = self._new_node(node, data[pos:], unit, key.extra_key, key.is_bigram)
            leaf.priority = priority
            leaf.value = value[pos // unit : n_units]
            self.evictable_size += leaf.length
            self._push(leaf)
            path.append(leaf)
        if self.tiers.write_policy is WritePolicy.WRITE_THROUGH:
            for n in path:
                if n.host_value is None and not self._backup(n):
                    break
        return on_device

    def insert_prefetched(
        self, key: RadixKey, start: int, pages: list[int], candidates: list[BundlePage]
    ) -> int:
        """Hang prefetched pages under the tree as host-only nodes; free any duplicates.

        Returns how many pages were inserted (the rest was there already, or had no parent).
        """
        end = start + len(pages) * self.page_size
        data, unit = self._pack(key.slice(0, end))
        namespace = (key.extra_key, key.is_bigram)
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._make_root(key)
        node, pos, _ = self._walk(root, data, unit, hit=False)
        have = pos // unit
        if have < start:  # the prefix it continued is gone: nothing to hang the pages from
            self.host.free(torch.tensor(pages, dtype=torch.int64))
            return 0
        dup = (have - start) // self.page_size
        if dup:
            self.host.free(torch.tensor(pages[:dup], dtype=torch.int64))
        if pos == len(data):
            return 0
        leaf = self._new_node(node, data[pos:], unit, *namespace)
        leaf.host_value = torch.tensor(pages[dup:], dtype=torch.int64)
        leaf.hash_value = [c.page_hash for c in candidates[dup:]]
        leaf.in_storage = True
        return len(pages) - dup

    # ----- device -> host -------------------------------------------------------------------
    def _backup(self, node: TreeNode, evicting: bool = False) -> bool:
        """Start copying ``node`` to host; whether it is there or on its way.

        Outside eviction a node is backed up only after its parent, so what is on host is a
        prefix of the tree; an evicted node is backed up whatever its parent (write_back), and
        then synchronously: its device slots are freed right after.
        """
        if node.host_value is not None:
            return True
        parent = node.parent
        if node.value is None or parent is None or not self.tiers.host_enabled:
            return False
        if not evicting and parent.parent is not None and parent.host_value is None:
            return False
        pages = self.host_evictor.alloc(node.length // self.page_size)
        if pages is None:
            return False
        node.host_value = pages
        transfer = self.controller.write(node.value, pages)
        if evicting:
            transfer.synchronize()
            self.writer.after_backup(node)
        else:
            self.inc_lock_ref(node)  # the device slots are read until the copy is done
            self._pending_writes.append((transfer, node))
        return True

    # ----- host -> device -------------------------------------------------------------------
    def init_load_back(self, node: TreeNode, mem_quota: int | None = None) -> tuple[Any, TreeNode]:
        """Load ``node`` and its ancestors that are on host only back to the device.

        Returns (device slots of the loaded span, the node the device prefix now ends at). All
        or nothing; nothing is loaded when the span is under the load-back threshold or over
        ``mem_quota``, or device slots cannot be freed for it.
        """
        chain: list[TreeNode] = []
        ancestor = node
        while ancestor.parent is not None and ancestor.value is None:
            chain.append(ancestor)
            ancestor = ancestor.parent
        tokens = sum(n.length for n in chain)
        none = self._concat([])
        if not chain or tokens < self.tiers.load_back_threshold_tokens:
            return none, ancestor if chain else node
        if mem_quota is not None and tokens > mem_quota:
            return none, ancestor
        self.inc_lock_ref(ancestor)  # keep the device prefix while making room below it
        self.host_evictor.anchors[node.id] += 1  # and the host chain, which eviction might take
        try:
            slots = self.device.alloc(tokens)
            if slots is None:
                self.evict(tokens)
                slots = self.device.alloc(tokens)
        finally:
            self.host_evictor.anchors[node.id] -= 1
            self.dec_lock_ref(ancestor)
        if slots is None:
            return none, ancestor
        chain.reverse()
        pages = torch.cat([_host_pages(n) for n in chain])
        self._pending_loads.append(self.controller.load(pages, slots))
        offset = 0
        for n in chain:
            n.value = slots[offset : offset + n.length]
            offset += n.length
            self.evictable_size += n.length
        if self._is_evictable_leaf(node):
            self._push(node)
        self.metrics.add("host_hit_tokens", tokens)
        return slots, node

    def ready_to_load_host_cache(self) -> list[GroupTransfer]:
        """The loads started since the last call: a forward pass waits on them per layer."""
        loads, self._pending_loads = self._pending_loads, []
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
                if self._is_evictable_leaf(node):
                    self._push(node)

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        if node.lock_ref > 0 or node.value is None or node.parent is None or not node.key:
            return False
        return all(child.value is None for child in node.children.values())

    def _evict_leaf(self, node: TreeNode) -> int:
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
            return super()._evict_leaf(node)
        # Backed up: free the device slots only; the node stays in the tree, on host.
        assert node.value is not None  # an evictable leaf holds device slots
        self.device.free(node.value)
        node.value = None
        self.evictable_size -= node.length
        if node.protected:
            self._unprotect(node)
        parent = node.parent
        assert parent is not None
        if parent.parent is not None and self._is_evictable_leaf(parent):
            self._push(parent)
        return node.length

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

    # ----- events ---------------------------------------------------------------------------
    def check_events(self) -> None:
        """Apply finished device-to-host copies, L3 writes and prefetches; once per step."""
        still: list[tuple[GroupTransfer, TreeNode]] = []
        for transfer, node in self._pending_writes:
            if transfer.done():
                self.dec_lock_ref(node)
                self.writer.after_backup(node)
            else:
                still.append((transfer, node))
        self._pending_writes = still
        self.writer.apply_acks()
        self.prefetcher.apply_finished()

    def reset(self) -> None:
        raise InvalidArgumentError("a HiRadixCache is not reset in place; build a new one")


def _host_pages(node: TreeNode) -> torch.Tensor:
    if node.host_value is None:
        raise AssertionError(f"node {node.id} is not on host")
    return node.host_value
