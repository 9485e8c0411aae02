"""HiRadixCache: the radix tree over three tiers (device, host, L3).

A node is on the device when ``value`` holds its slots, on host when ``host_value`` holds its
host slots (one per token: page ``p`` holds slots ``p * page_size ...``, so splits cut it like
``value``), and known to be in L3 when ``in_storage`` (set from write acknowledgements). Nodes on
the device form the top of the tree: a device node's ancestors are all on the device. A node
on neither device nor host is removed.

Hits: ``hit_count`` counts the requests whose ``match_prefix`` reached a node (the tree's own
re-match inside ``cache_unfinished_req`` is not a hit). Write policies read it:

* ``write_through``: every node is backed up to host when it is inserted;
* ``write_through_selective``: a node is backed up once its hit count reaches the threshold;
* ``write_back``: a node is backed up when the device evicts it.

Backed-up nodes form the top of the tree too (a node is backed up only after its parent), so a
host hit is a prefix. Device eviction keeps a backed-up node on host and drops one that is not
(write_back backs it up first). Host eviction removes leaves that are on host only, unlocked,
not protected by an L3 write in flight and not anchoring a prefetch.

Everything here runs on the scheduler's thread; :meth:`check_events` applies, once per scheduler
step, what the controller finished meanwhile.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.node import TreeNode
from hicache.radix.tree import MatchResult, RadixCacheConfig
from hicache.tiering.controller import GroupTransfer, HiCacheController
from hicache.tiering.l3_tree import L3TreeBase
from hicache.tiering.policies import WritePolicy, backup_on_hit

__all__ = ["HiRadixCache"]


class HiRadixCache(L3TreeBase):
    """A :class:`RadixCache` whose nodes move between device, host and L3."""

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
        self.metrics = controller.metrics
        self._pending_writes: list[tuple[GroupTransfer, TreeNode]] = []
        self._pending_loads: list[GroupTransfer] = []
        self._anchors: Counter[int] = Counter()  # node id -> prefetches hanging from it
        self._quiet = False  # the tree matching for itself: no hits, no policy
        self._kept: list[TreeNode] = []  # leaves an eviction kept (see evict)
        self._init_l3()

    # ----- matching -------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The device hit, then the host hit after it (``last_host_node``, ``host_hit_length``)."""
        data, unit = self._pack(key)
        root = self._roots.get((key.extra_key, key.is_bigram))
        if root is None:
            root = self._make_root(key)
            return MatchResult(0, root, self._concat([]), root, 0)
        _, _, path = self._walk(root, data, unit, hit=not self._quiet)
        n_device = 0
        while n_device < len(path) and path[n_device].value is not None:
            n_device += 1
        device, host = path[:n_device], path[n_device:]
        last_device = device[-1] if device else root
        result = MatchResult(sum(n.length for n in device), last_device, path=device)
        result.device_indices = self._concat([n.value for n in device])
        result.last_host_node = host[-1] if host else last_device
        result.host_hit_length = sum(n.length for n in host)
        if not self._quiet:
            self.metrics.add("device_hit_tokens", result.prefix_len)
            self._on_hits(path)
        return result

    def peek_match(self, key: RadixKey) -> MatchResult:
        """:meth:`match_prefix` that counts no hit and triggers no write policy: for deciding
        about a request before it is scheduled (whether to prefetch it)."""
        quiet, self._quiet = self._quiet, True
        try:
            return self.match_prefix(key)
        finally:
            self._quiet = quiet

    def _on_hits(self, path: list[TreeNode]) -> None:
        policy, threshold = self.tiers.write_policy, self.tiers.write_threshold
        if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in path:
                if node.value is None or node.host_value is not None:
                    continue
                if not backup_on_hit(policy, node.hit_count, threshold) or not self._backup(node):
                    break
        self._admit_path(path)

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

    def cache_unfinished_req(self, req: CachedRequest) -> None:
        self._quiet = True
        try:
            super().cache_unfinished_req(req)
        finally:
            self._quiet = False

    # ----- device -> host -------------------------------------------------------------------
    def _backup(self, node: TreeNode, evicting: bool = False) -> bool:
        """Start copying ``node`` to host; whether it is there or on its way.

        Outside eviction a node is backed up only after its parent, so what is on host is a
        prefix of the tree; an evicted node is backed up whatever its parent (write_back).
        """
        if node.host_value is not None:
            return True
        parent = node.parent
        if node.value is None or parent is None or not self.tiers.host_enabled:
            return False
        if not evicting and parent.parent is not None and parent.host_value is None:
            return False
        pages = self._alloc_host(node.length // self.page_size)
        if pages is None:
            return False
        node.host_value = self._host_slots(pages)
        self.inc_lock_ref(node)  # the device slots are read until the copy is done
        self._pending_writes.append((self.controller.write(node.value, pages), node))
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
        self._anchors[node.id] += 1  # and the host chain, which a write_back eviction might take
        try:
            slots = self.allocator.alloc(tokens)
            if slots is None:
                self.evict(tokens)
                slots = self.allocator.alloc(tokens)
        finally:
            self._anchors[node.id] -= 1
            self.dec_lock_ref(ancestor)
        if slots is None:
            return none, ancestor
        chain.reverse()
        pages = torch.cat([self.host_pages(n) for n in chain])
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
        if needs_backup and not self._backup_now(node) and node.children:
            self._kept.append(node)  # its host-only children would lose their parent: not now
            return 0
        freed = super()._evict_leaf(node) if node.host_value is None else self._demote(node)
        self.metrics.add("device_evicted_tokens", freed)
        return freed

    def _backup_now(self, node: TreeNode) -> bool:
        if not self.tiers.host_enabled or not self._backup(node, evicting=True):
            return False
        transfer, locked = self._pending_writes.pop()
        transfer.synchronize()  # write_back: the slots are freed right after this
        self.dec_lock_ref(locked)
        self._after_backup(locked)
        return True

    def _demote(self, node: TreeNode) -> int:
        """Free the device slots of a backed-up node; it stays in the tree, on host."""
        parent = node.parent
        assert parent is not None
        self.allocator.free(node.value)
        node.value = None
        self.evictable_size -= node.length
        if node.protected:
            self._unprotect(node)
        if parent.parent is not None and self._is_evictable_leaf(parent):
            self._push(parent)
        return node.length

    # ----- host eviction --------------------------------------------------------------------
    def _host_evictable(self, node: TreeNode) -> bool:
        if node.value is not None or node.host_value is None or node.children:
            return False
        if node.lock_ref > 0 or self._anchors[node.id] > 0:
            return False
        return not bool(self.host.is_protected(self.host_pages(node)).any())

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens, by the tree's policy: host-only leaves
        first, then host copies that are redundant (the node is on the device and in L3)."""
        nodes = self.all_nodes()
        heap = [(self._key_fn(n), n.id, n) for n in nodes if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            freed += self._drop_host(node)
            if parent.parent is not None and self._host_evictable(parent):
                heapq.heappush(heap, (self._key_fn(parent), parent.id, parent))
        if freed < num_tokens:
            freed += self._drop_redundant_copies(nodes, num_tokens - freed)
        self.metrics.add("host_evicted_tokens", freed)
        return freed

    def _drop_redundant_copies(self, nodes: list[TreeNode], num_tokens: int) -> int:
        """Free host copies of nodes that stay on the device and are in L3: no data is lost,
        and a later device eviction backs them up again or drops them (write policy)."""
        redundant = [
            n
            for n in nodes
            if n.value is not None
            and n.host_value is not None
            and n.in_storage
            and not bool(self.host.is_protected(self.host_pages(n)).any())
        ]
        redundant.sort(key=self._key_fn)
        freed = 0
        for node in redundant:
            if freed >= num_tokens:
                break
            self.host.free(self.host_pages(node))
            node.host_value = None
            freed += node.length
        return freed

    def _drop_host(self, node: TreeNode) -> int:
        parent = node.parent
        assert parent is not None
        self.host.free(self.host_pages(node))
        node.host_value = None
        del parent.children[node.key[: self.page_size * (8 if node.namespace[1] else 4)]]
        node.parent = None
        self.total_nodes -= 1
        if parent.parent is None and not parent.children:
            del self._roots[parent.namespace]
        return node.length

    # ----- events ---------------------------------------------------------------------------
    def check_events(self) -> None:
        """Apply finished device-to-host copies, L3 writes and prefetches; once per step."""
        still: list[tuple[GroupTransfer, TreeNode]] = []
        for transfer, node in self._pending_writes:
            if transfer.done():
                self.dec_lock_ref(node)
                self._after_backup(node)
            else:
                still.append((transfer, node))
        self._pending_writes = still
        self._drain_l3()

    def reset(self) -> None:
        raise InvalidArgumentError("a HiRadixCache is not reset in place; build a new one")
