"""RadixCache: the prefix tree over page-aligned token spans (RadixAttention).

Keys are packed once into bytes (4 bytes a token, 8 a bigram pair), so walking the tree compares
whole node spans with one ``bytes.startswith`` in C, and a mismatch inside a span is found by a
binary search over pages: the cost of a match grows with the matched pages, not with the number
of cached sequences. Eviction keeps a lazy heap of evictable leaves keyed by the policy, so an
eviction costs O(log n) per freed node instead of a scan of the tree.

Sizes: ``evictable_size`` counts the tokens of unlocked nodes that hold KV, ``protected_size``
those of locked nodes; both are kept exact by every operation.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache.errors import InvalidArgumentError, InvalidTokenError
from hicache.keys import RadixKey
from hicache.radix.eviction import EvictionHeap, EvictionPolicy, eviction_key
from hicache.radix.lifecycle import CachedRequest, cache_finished_req, cache_unfinished_req
from hicache.radix.node import TreeNode
from hicache.radix.packing import common_prefix_bytes, unit_bytes
from hicache.radix.packing import pack_key as pack_units
from hicache.radix.pins import Pins
from hicache.radix.slots import SlotAllocator, concat_slots
from hicache.radix.slru import ProtectedSegment
from hicache.radix.tier_peek import TierPeek, peek_tiers

if TYPE_CHECKING:
    from hicache.pools.req_to_token import ReqToTokenPool
    from hicache.radix.hooks import TreeHooks

__all__ = ["MatchResult", "RadixCache", "RadixCacheConfig", "TierPeek"]

# The slots of every simulated match: one shared empty tensor, so a simulated match (the radix
# benchmark's hot loop) allocates nothing. Never written to: an empty tensor has no elements.
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class RadixCacheConfig:
    page_size: int = 1
    policy: EvictionPolicy = EvictionPolicy.LRU
    simulated: bool = False  # hold no KV: for scheduling decisions and trace replay
    slru_protected_share: float = 0.8  # SLRU: at most this share of cached tokens is protected

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise InvalidArgumentError(f"page_size must be a positive int, got {self.page_size}")
        if not isinstance(self.policy, EvictionPolicy):
            raise InvalidArgumentError("policy must be an EvictionPolicy")
        if not 0.0 <= self.slru_protected_share <= 1.0:
            raise InvalidArgumentError("slru_protected_share must be in [0, 1]")


@dataclass(slots=True)
class MatchResult:
    """The longest cached page-aligned prefix of a key.

    ``device_indices`` are the device slots of the prefix (empty in a simulated tree).
    ``last_host_node`` and ``host_hit_length`` are filled by HiRadixCache (host tier).
    """

    prefix_len: int
    last_device_node: TreeNode
    device_indices: torch.Tensor = _NO_SLOTS
    last_host_node: TreeNode | None = None
    host_hit_length: int = 0
    path: list[TreeNode] = field(default_factory=list)


class RadixCache:
    """A radix tree of cached token prefixes, one subtree per namespace.

    Extension points (:mod:`hicache.radix.hooks`): a subclass overrides the hooks
    :meth:`split_span`, :meth:`is_evictable_leaf` and :meth:`evict_leaf`, and builds on the
    public tree operations listed there (:meth:`walk`, :meth:`touch_path`, :meth:`add_leaf`,
    ...); the members whose names start with ``_`` are the tree's own.
    """

    def __init__(
        self,
        config: RadixCacheConfig | None = None,
        allocator: SlotAllocator | None = None,
        req_to_token: ReqToTokenPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or RadixCacheConfig()
        self.page_size = self.config.page_size
        self.allocator = allocator  # frees the slots of evicted nodes
        self.req_to_token = req_to_token  # the request lifecycle's table (ReqToTokenPool)
        self._clock = clock
        self._ids = itertools.count(1)
        self._ticks = itertools.count(1)
        self._roots: dict[tuple[str | None, bool], TreeNode] = {}
        self.eviction_order = eviction_key(self.config.policy)  # a node's sort key: first out first
        self._heap = EvictionHeap(self.eviction_order)
        self._slru = ProtectedSegment()  # SLRU's protected nodes
        self._pins = Pins(clock)
        self.evictable_size = 0
        self.protected_size = 0
        self.total_nodes = 0

    # ----- public API -----------------------------------------------------------------------
    def match_prefix(self, key: RadixKey, count_hits: bool = True) -> MatchResult:
        """The longest cached page-aligned prefix of ``key``; counts a hit on every matched node
        unless ``count_hits`` is False (the tree matching for itself, or a scheduling peek).

        A match that ends inside a node splits it at that page boundary, so the returned last
        node covers exactly the prefix.
        """
        data, unit = self.pack_key(key)
        root = self._roots.get((key.extra_key, key.is_bigram))
        if root is None:  # nothing cached in this namespace: register no root for a miss
            result = MatchResult(0, self.detached_root(key))
        else:
            node, pos, path = self.walk(root, data, unit, hit=count_hits)
            result = MatchResult(pos // unit, node, path=path)
        if not self.config.simulated:
            result.device_indices = concat_slots([n.value for n in result.path])
        return result

    def peek_prefix(self, key: RadixKey) -> tuple[int, TreeNode | None]:
        """How much of ``key`` is cached, without touching the tree.

        No split, no hit counted, no access time refreshed: for scheduling and routing
        decisions that must not disturb eviction order. Returns the matched units and the
        deepest node the match reaches (it may end inside that node), or ``(0, None)``.
        """
        peek = RadixCache.peek_tiers(self, key)
        return peek.total, peek.last_node

    def peek_tiers(self, key: RadixKey) -> TierPeek:
        """How much of ``key`` is cached on the device, and on host after that, without
        touching the tree (as :meth:`peek_prefix`; see :func:`~hicache.radix.tier_peek.peek_tiers`).
        A simulated tree holds no slots on any tier: all it matches counts as device.
        """
        data, unit = self.pack_key(key)
        root = self._roots.get((key.extra_key, key.is_bigram))
        return peek_tiers(root, data, unit, self.page_size)

    def insert(self, key: RadixKey, value: torch.Tensor | None = None, priority: int = 0) -> int:
        """Cache ``key`` (truncated to whole pages) with its device slots ``value``.

        Returns how many units were already cached: the caller owns the slots of that part of
        ``value`` and should free them (the tree keeps its own). Refreshes access time and
        priority along the shared path.
        """
        data, unit = self.pack_key(key)
        n_units = len(data) // unit
        if self.config.simulated:
            value = None
        elif value is None or len(value) < n_units:
            got = "no value" if value is None else f"{len(value)} slots"
            raise InvalidArgumentError(f"insert of {n_units} units needs as many slots, got {got}")
        elif len(value) != len(key):
            raise InvalidArgumentError(f"a key of {len(key)} units with {len(value)} slots")
        if not data:
            return 0  # shorter than a page: nothing to cache
        node, pos, _ = self.walk(self.ensure_root(key), data, unit, hit=False, priority=priority)
        if pos < len(data):
            slots = None if value is None else value[pos // unit : n_units]
            self.add_leaf(node, data[pos:], slots, priority)
        return pos // unit

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors: none of them is evicted until unlocked."""
        for n in node.path_to_root():
            if n.lock_ref == 0:
                self.evictable_size -= n.length
                self.protected_size += n.length
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref`; raises (and changes nothing) if it would go negative."""
        path = node.path_to_root()
        if any(n.lock_ref <= 0 for n in path):
            raise InvalidArgumentError(f"dec_lock_ref below zero on {node!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.protected_size -= n.length
                self.evictable_size += n.length
                self.requeue(n)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens of unlocked leaves, by policy, if there are as many.

        Whole nodes are freed, so the result may exceed the request; it is exactly what was freed.
        """
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"evict needs a non-negative int, got {num_tokens!r}")
        for pinned in self._pins.expired():
            self.dec_lock_ref(pinned)
        freed = 0
        while freed < num_tokens and (node := self._heap.pop()) is not None:
            if self.is_evictable_leaf(node):  # else it was locked or grew children since
                freed += self.evict_leaf(node)
        if len(self._heap) > 1024 and len(self._heap) > 4 * self.total_nodes:
            self._rebuild_heap()
        return freed

    def cache_finished_req(self, req: CachedRequest) -> None:
        """Commit a finished request's KV; see :mod:`hicache.radix.lifecycle`."""
        cache_finished_req(self, req)

    def cache_unfinished_req(self, req: CachedRequest) -> None:
        """Commit a running request's KV and move its lock; see :mod:`hicache.radix.lifecycle`."""
        cache_unfinished_req(self, req)

    def pin(self, key: RadixKey, ttl_s: float) -> TreeNode | None:
        """Keep the cached prefix of ``key`` from eviction for ``ttl_s`` seconds.

        Returns the pinned node (None if nothing is cached). A pin is a lock that the tree
        releases itself once it expires (checked at each eviction) or on :meth:`unpin`.
        """
        if ttl_s <= 0:
            raise InvalidArgumentError(f"a pin needs a positive ttl, got {ttl_s}")
        match = self.match_prefix(key)
        if match.prefix_len == 0:
            return None
        node = match.last_device_node
        self.inc_lock_ref(node)
        self._pins.add(node, ttl_s)
        return node

    def unpin(self, node: TreeNode) -> None:
        """Release one pin of ``node`` before it expires."""
        if not self._pins.remove(node):
            raise InvalidArgumentError(f"{node!r} is not pinned")
        self.dec_lock_ref(node)

    def all_nodes(self) -> list[TreeNode]:
        """Every node except the namespace roots (for tests, tools and DFS orderings)."""
        out: list[TreeNode] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                out.append(child)
                stack.append(child)
        return out

    def namespace_root(self, extra_key: str | None, is_bigram: bool = False) -> TreeNode | None:
        return self._roots.get((extra_key, is_bigram))

    @property
    def total_size(self) -> int:
        """Tokens cached on the device (simulated: tokens in the tree)."""
        return self.evictable_size + self.protected_size

    def reset(self) -> None:
        for node in self.all_nodes():
            if node.value is not None and self.allocator is not None:
                self.allocator.free(node.value)
        self.__init__(  # type: ignore[misc]
            self.config, self.allocator, self.req_to_token, self._clock
        )

    # ----- tree operations, for the trees built on this one (see hicache.radix.hooks) -------
    def pack_key(self, key: RadixKey) -> tuple[bytes, int]:
        """``key``'s whole pages packed as the tree compares them, and the bytes of one unit
        (4 a token, 8 a bigram pair); raises unless ``key`` is a non-empty RadixKey."""
        if not isinstance(key, RadixKey):
            raise InvalidArgumentError(f"expected a RadixKey, got {type(key).__name__}")
        if len(key) == 0:
            raise InvalidTokenError("an empty key cannot be matched or cached")
        return pack_units(key, self.page_size)

    def ensure_root(self, key: RadixKey) -> TreeNode:
        """``key``'s namespace root, registered now if the namespace had none."""
        namespace = (key.extra_key, key.is_bigram)
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self.detached_root(key)
        return root

    def detached_root(self, key: RadixKey) -> TreeNode:
        """A new root for ``key``'s namespace that the tree does not register: the last node
        of a match that found nothing where the namespace holds nothing."""
        root = TreeNode(0, b"", 0, None, self._clock())
        root.lock_ref = 1  # never evicted; locking it through a match is a no-op
        root.namespace = (key.extra_key, key.is_bigram)
        return root

    def walk(
        self, root: TreeNode, data: bytes, unit: int, hit: bool, priority: int = 0
    ) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follow ``data`` (packed by :meth:`pack_key`) from ``root`` as far as the tree holds
        it, splitting the node it ends inside at that page boundary and touching each node it
        follows as :meth:`touch_path` does (raising priorities to ``priority``). Returns (the
        last node, the bytes matched, the nodes matched)."""
        page_bytes = self.page_size * unit
        now, tick = self._clock(), next(self._ticks)
        node, pos, end, path = root, 0, len(data), []
        while pos < end:
            child = node.children.get(data[pos : pos + page_bytes])
            if child is None:
                break
            span = child.key
            if not data.startswith(span, pos):
                child = self.split_span(
                    child, common_prefix_bytes(span, data, pos, page_bytes), unit
                )
                span = child.key
            self._touch(child, now, tick, hit, priority)
            path.append(child)
            pos += len(span)
            node = child
        if path:
            self.requeue(node)  # its sort key changed
        return node, pos, path

    def touch_path(self, path: list[TreeNode], hit: bool) -> None:
        """Refresh the access time of the matched nodes ``path`` (one clock reading for all),
        count a hit on each when ``hit`` (SLRU: promote it), and requeue the last, whose sort
        key changed: what :meth:`walk` does, for a match that found its nodes by a peek."""
        now, tick = self._clock(), next(self._ticks)
        for node in path:
            self._touch(node, now, tick, hit, 0)
        if path:
            self.requeue(path[-1])

    def add_leaf(
        self, parent: TreeNode, span: bytes, slots: torch.Tensor | None, priority: int = 0
    ) -> TreeNode:
        """Hang a new leaf for ``span`` (packed units of ``parent``'s namespace, whole pages)
        under ``parent``, holding the device slots ``slots`` (None in a simulated tree): its
        units count as evictable and it is queued for eviction. Returns it."""
        leaf = self._new_node(parent, span)
        leaf.priority = priority
        leaf.value = slots
        self.evictable_size += leaf.length
        self._heap.push(leaf)
        return leaf

    def release_device_slots(self, node: TreeNode) -> None:
        """Free ``node``'s device slots (to the tree's allocator) and stop counting them; the
        node stays in the tree, its data on another tier, unless the caller detaches it."""
        if node.value is not None and self.allocator is not None:
            self.allocator.free(node.value)
        node.value = None
        self.evictable_size -= node.length
        if node.protected:
            self._slru.remove(node)

    def requeue(self, node: TreeNode) -> None:
        """Queue ``node`` for eviction when it is an evictable leaf now: after a change the
        tree's own steps do not see (data arrived, a lock held outside the tree let go)."""
        if self.is_evictable_leaf(node):
            self._heap.push(node)

    def detach_leaf(self, node: TreeNode) -> None:
        """Unlink a childless node from its parent (its data is the caller's to free); a
        namespace root left without children goes too."""
        parent = node.parent
        if parent is None or node.children:
            raise InvalidArgumentError("only a leaf under a parent can be detached")
        del parent.children[node.key[: self.page_size * unit_bytes(node.namespace[1])]]
        node.parent = None
        self.total_nodes -= 1
        if parent.parent is None and not parent.children:
            del self._roots[parent.namespace]

    # ----- hooks (see hicache.radix.hooks) ---------------------------------------------------
    def split_span(self, child: TreeNode, nbytes: int, unit: int) -> TreeNode:
        """Cut ``child`` after ``nbytes``; the new upper node takes its place and is returned."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(next(self._ids), child.key[:nbytes], nbytes // unit, parent, 0.0)
        for name in ("creation_time", "last_access_time", "access_tick", "hit_count",
                     "priority", "lock_ref", "namespace", "in_storage"):  # fmt: skip
            setattr(upper, name, getattr(child, name))
        cut = upper.length
        if child.value is not None:
            upper.value, child.value = child.value[:cut], child.value[cut:]
        pages = cut // self.page_size
        if child.host_value is not None:  # host pages: one per token page
            host = child.host_value
            upper.host_value, child.host_value = host[:pages], host[pages:]
        if child.hash_value is not None:
            upper.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        first_page = child.key[: self.page_size * unit]
        child.key = child.key[nbytes:]
        child.length -= cut
        child.parent = upper
        upper.children[child.key[: self.page_size * unit]] = child
        parent.children[first_page] = upper
        self.total_nodes += 1
        if child.protected:
            self._slru.split(upper)
        return upper

    def is_evictable_leaf(self, node: TreeNode) -> bool:
        """Whether :meth:`evict` may take ``node``: unlocked, holding KV (or simulated), not a
        namespace root, and childless."""
        if node.lock_ref > 0 or (node.value is None and not self.config.simulated):
            return False
        if node.parent is None or not node.key:
            return False  # a namespace root
        return not node.children

    def evict_leaf(self, node: TreeNode) -> int:
        """Free ``node``'s device slots and take it out of the tree; its parent may be next."""
        self.release_device_slots(node)
        parent = node.parent
        self.detach_leaf(node)
        if parent is not None:
            self.requeue(parent)
        return node.length

    # ----- the tree's own steps ---------------------------------------------------------------
    def _touch(self, node: TreeNode, now: float, tick: int, hit: bool, priority: int) -> None:
        node.last_access_time = now
        node.access_tick = tick
        if priority > node.priority:
            node.priority = priority
        if hit:
            node.hit_count += 1
            if self.config.policy is EvictionPolicy.SLRU:
                limit = self.config.slru_protected_share * self.total_size
                for demoted in self._slru.promote(node, limit):
                    self.requeue(demoted)

    def _rebuild_heap(self) -> None:
        self._heap.clear()
        for node in self.all_nodes():
            self.requeue(node)

    def _new_node(self, parent: TreeNode, span: bytes) -> TreeNode:
        """A new child of ``parent`` (in its namespace) for the packed units ``span``."""
        unit = unit_bytes(parent.namespace[1])
        node = TreeNode(next(self._ids), span, len(span) // unit, parent, self._clock())
        node.access_tick = next(self._ticks)
        node.namespace = parent.namespace
        parent.children[span[: self.page_size * unit]] = node
        self.total_nodes += 1
        return node


if TYPE_CHECKING:  # mypy checks that the tree has the hooks it declares
    _hooks: type[TreeHooks] = RadixCache
