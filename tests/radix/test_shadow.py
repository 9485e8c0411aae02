"""ShadowRadixCache: one tree over many pools, each pool's hit rule, the two-counter lock."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.pools import ModelShape, PoolPreset, TokenSlotAllocator, preset
from hicache.radix import RadixCache, RadixCacheConfig
from hicache.radix.shadow import ShadowRadixCache

PAGE = 4
SHAPE = ModelShape(page_size=PAGE, window=8)  # SWA window: 2 pages


def make(kind: PoolPreset, size: int = 256) -> ShadowRadixCache:
    pools = preset(kind, SHAPE)
    tree_pools = [p for p in pools if p.shares_slots_with is None]
    allocators = {
        p.name: TokenSlotAllocator(size, p.page_size if p.page_size > 1 else 1) for p in tree_pools
    }
    return ShadowRadixCache(pools, allocators)


def alloc(tree: ShadowRadixCache, pool: str, n: int) -> torch.Tensor:
    slots = tree.allocators[pool].alloc(n)
    assert slots is not None
    return slots


def swa_slots(tree: ShadowRadixCache, n: int, held_pages: int) -> torch.Tensor:
    """``n`` tokens whose SWA pool holds only the last ``held_pages`` pages."""
    out = torch.full((n,), -1, dtype=torch.int64)
    if held_pages:
        out[n - held_pages * PAGE :] = alloc(tree, "swa", held_pages * PAGE)
    return out


def free_slots(tree: ShadowRadixCache, pool: str) -> int:
    return int(tree.allocators[pool].available_size)


def check_sizes(tree: ShadowRadixCache) -> None:
    """Every pool's sizes equal a recount over the nodes, and match its allocator."""
    nodes, ledger = tree.all_nodes(), tree.ledger
    for name in tree.roles.extra:
        held = [n for n in nodes if ledger.data(n, name) is not None]
        total = sum(len(ledger.data(n, name)) for n in held)
        locked = sum(len(ledger.data(n, name)) for n in held if ledger.lock_ref(n, name))
        assert (ledger.size(name), ledger.protected(name)) == (total, locked)
        assert ledger.evictable(name) == total - locked
        alloc_ = tree.allocators[name]
        assert alloc_.size - alloc_.available_size == total
    anchor, held = tree.roles.anchor, [n for n in nodes if n.value is not None]
    assert ledger.size(anchor) == sum(n.length for n in held)
    assert ledger.protected(anchor) == sum(n.length for n in held if n.lock_ref)
    alloc_ = tree.allocators[anchor]
    assert alloc_.size - alloc_.available_size == ledger.size(anchor)
    for node in nodes:  # the anchor's nodes are the top of the tree; no node holds nothing
        assert node.value is None or node.parent.parent is None or node.parent.value is not None
        assert node.value is not None or node.children or ledger.holds_any(node)


def key(n: int, start: int = 0) -> RadixKey:
    return RadixKey(list(range(start, start + n)))


# ----- SWA ----------------------------------------------------------------------------------
def test_swa_hit_needs_its_window_pages() -> None:
    tree = make(PoolPreset.SWA)
    # 24 tokens (6 pages) whose SWA pages are held only for the last two pages: a full hit.
    result = tree.insert_bundle(key(24), alloc(tree, "kv", 24), {"swa": swa_slots(tree, 24, 2)})
    assert result.already == 0 and result.unused["swa"].numel() == 0
    full = tree.match_prefix(key(24))
    assert full.prefix_len == 24
    assert (full.pool_indices["swa"][16:] >= 0).all() and (
        full.pool_indices["swa"][:16] == -1
    ).all()
    # A 16-token prefix has its window at pages 2-3, which the pool dropped: not a hit there, and
    # no shorter prefix has its window either (only the empty prefix is usable).
    assert tree.match_prefix(key(16)).prefix_len == 0
    assert tree.match_prefix(key(20)).prefix_len == 0  # window = pages 3 and 4, page 3 missing
    check_sizes(tree)


def test_swa_match_stops_where_the_window_holds() -> None:
    tree = make(PoolPreset.SWA)
    tree.insert_bundle(key(16), alloc(tree, "kv", 16), {"swa": swa_slots(tree, 16, 4)})
    # Extend by 2 pages whose SWA data is missing: the match falls back to 16 tokens.
    longer = torch.cat([tree.match_prefix(key(16)).device_indices, alloc(tree, "kv", 8)])
    tree.insert_bundle(key(24), longer, {"swa": torch.full((24,), -1)})
    match = tree.match_prefix(key(24))
    assert match.prefix_len == 16 and len(match.device_indices) == 16
    assert match.last_device_node.length + sum(n.length for n in match.path[:-1]) == 16
    check_sizes(tree)


def test_evict_pool_keeps_long_prefixes_whose_window_survives() -> None:
    tree = make(PoolPreset.SWA)
    tree.insert_bundle(key(16), alloc(tree, "kv", 16), {"swa": swa_slots(tree, 16, 4)})
    tail = torch.cat([torch.full((16,), -1), alloc(tree, "swa", 8)])
    kv = torch.cat([tree.match_prefix(key(16)).device_indices, alloc(tree, "kv", 8)])
    res = tree.insert_bundle(key(24), kv, {"swa": tail})
    assert res.already == 16 and res.unused["swa"].numel() == 0
    tree.match_prefix(key(24))  # the long prefix is the most recently used
    kv_before = free_slots(tree, "kv")
    # The 16-token node is older and unlocked: evict_pool drops its SWA data, nothing else.
    assert tree.evict_pool("swa", 1) == 16
    assert free_slots(tree, "kv") == kv_before and tree.total_nodes == 2
    assert tree.match_prefix(key(24)).prefix_len == 24  # its window (pages 4-5) is still there
    assert tree.match_prefix(key(16)).prefix_len == 0  # its window was dropped: falls back
    check_sizes(tree)


def test_swa_duplicates_are_returned_and_dropped_nodes_refill() -> None:
    tree = make(PoolPreset.SWA)
    kv = alloc(tree, "kv", 8)
    tree.insert_bundle(key(8), kv, {"swa": swa_slots(tree, 8, 2)})
    dup = swa_slots(tree, 8, 2)
    res = tree.insert_bundle(key(8), kv, {"swa": dup})
    assert res.already == 8 and torch.equal(res.unused["swa"], dup)  # the tree kept its own
    tree.allocators["swa"].free(dup)
    assert tree.evict_pool("swa", 8) == 8 and tree.match_prefix(key(8)).prefix_len == 0
    # Re-inserting the span with its window pages refills the dropped node.
    res = tree.insert_bundle(key(8), kv, {"swa": swa_slots(tree, 8, 2)})
    assert res.unused["swa"].numel() == 0 and tree.match_prefix(key(8)).prefix_len == 8
    check_sizes(tree)


def test_swa_window_lock_is_exact_across_splits() -> None:
    tree = make(PoolPreset.SWA)
    tree.insert_bundle(key(24), alloc(tree, "kv", 24), {"swa": swa_slots(tree, 24, 6)})
    node = tree.match_prefix(key(24)).last_device_node
    tree.inc_lock_ref(node)
    tree.ledger.lock(node, "swa")  # the window: the last 2 pages
    assert tree.ledger.protected("swa") == 24  # one node: locked whole
    tree.match_prefix(key(8))  # splits the node at 8 tokens: the upper half is outside the window
    upper = tree.match_prefix(key(8)).last_device_node
    assert tree.ledger.lock_ref(upper, "swa") == 0 and tree.ledger.lock_ref(node, "swa") == 1
    assert tree.ledger.protected("swa") == 16
    # The tree lock does not keep a pool's data: the unlocked upper half loses it.
    assert tree.evict_pool("swa", 100) == 8
    assert tree.ledger.data(node, "swa") is not None and tree.evict(100) == 0
    tree.ledger.unlock(node, "swa")
    tree.dec_lock_ref(node)
    assert tree.ledger.protected("swa") == 0 and tree.ledger.protected("kv") == 0
    check_sizes(tree)


# ----- hybrid (state snapshots) -------------------------------------------------------------
def test_hybrid_hit_ends_at_the_deepest_snapshot() -> None:
    tree = make(PoolPreset.HYBRID)
    tree.insert_bundle(key(8), alloc(tree, "kv", 8), {"conv": alloc(tree, "conv", 1)})
    kv = torch.cat([tree.match_prefix(key(8)).device_indices, alloc(tree, "kv", 16)])
    tree.insert(key(24), kv)  # no snapshot at 24
    match = tree.match_prefix(key(24))
    assert match.prefix_len == 8 and match.pool_indices["conv"] is not None
    assert match.pool_indices["ssm"] is match.pool_indices["conv"]  # the sidecar shares slots
    # A snapshot mid-node does not exist: a 16-token query matches only 8 too.
    assert tree.match_prefix(key(16)).prefix_len == 8
    # A snapshot at 24 makes the whole prefix usable; 16 still is not (no snapshot at its end).
    res = tree.insert_bundle(key(24), kv, {"conv": alloc(tree, "conv", 1)})
    assert res.already == 24 and res.unused["conv"].numel() == 0
    assert tree.match_prefix(key(24)).prefix_len == 24
    assert tree.match_prefix(key(20)).prefix_len == 8
    assert tree.ledger.size("conv") == tree.ledger.size("ssm") == 2
    check_sizes(tree)


def test_duplicate_snapshot_is_returned_and_each_pool_evicts_its_own() -> None:
    tree = make(PoolPreset.HYBRID)
    kv = alloc(tree, "kv", 8)
    tree.insert_bundle(key(8), kv, {"conv": alloc(tree, "conv", 1)})
    again = alloc(tree, "conv", 1)
    res = tree.insert_bundle(key(8), kv, {"conv": again})
    assert torch.equal(res.unused["conv"], again)
    tree.allocators["conv"].free(again)
    assert tree.evict(8) == 8 and free_slots(tree, "kv") == 256
    assert tree.ledger.size("conv") == 1 and free_slots(tree, "conv") == 255  # not the anchor's
    assert tree.match_prefix(key(8)).prefix_len == 0 and tree.total_nodes == 1
    check_sizes(tree)
    assert tree.evict_pool("conv", 1) == 1  # the last data on the node: it leaves the tree
    assert tree.total_nodes == 0 and free_slots(tree, "conv") == 256
    check_sizes(tree)


def test_state_pool_lock_keeps_the_snapshot_from_evict_pool() -> None:
    tree = make(PoolPreset.HYBRID)
    tree.insert_bundle(key(8), alloc(tree, "kv", 8), {"conv": alloc(tree, "conv", 1)})
    node = tree.match_prefix(key(8)).last_device_node
    tree.ledger.lock(node, "ssm")  # a sidecar locks its owner
    assert tree.evict_pool("conv", 1) == 0  # pool-locked: kept
    assert tree.evict(8) == 8  # the pool lock holds the snapshot, not the anchor
    assert tree.ledger.protected("conv") == 1 and tree.total_nodes == 1
    check_sizes(tree)
    tree.ledger.unlock(node, "conv")
    assert tree.evict_pool("conv", 1) == 1 and tree.match_prefix(key(8)).prefix_len == 0
    assert tree.total_nodes == 0  # nothing left on it: out of the tree
    check_sizes(tree)


def test_tree_unlock_lets_evict_free_the_anchor_and_a_pool_lock_keeps_the_node() -> None:
    tree = make(PoolPreset.HYBRID)
    tree.insert_bundle(key(8), alloc(tree, "kv", 8), {"conv": alloc(tree, "conv", 1)})
    node = tree.match_prefix(key(8)).last_device_node
    tree.inc_lock_ref(node)
    assert tree.evict(8) == 0  # the eviction heap drops the leaf's entry: it is tree-locked
    tree.dec_lock_ref(node)  # re-queues the leaf, so evict finds it again
    tree.ledger.lock(node, "conv")
    assert tree.evict(8) == 8 and free_slots(tree, "kv") == 256
    assert tree.total_nodes == 1 and free_slots(tree, "conv") == 255  # the snapshot stays
    assert tree.evict_pool("conv", 1) == 0  # locked
    tree.ledger.unlock(node, "conv")
    assert tree.evict_pool("conv", 1) == 1 and tree.total_nodes == 0
    check_sizes(tree)


def test_ledger_refuses_the_anchor_and_a_second_put() -> None:
    tree = make(PoolPreset.SWA)
    tree.insert_bundle(key(8), alloc(tree, "kv", 8), {"swa": swa_slots(tree, 8, 2)})
    node = tree.match_prefix(key(8)).last_device_node
    before = snapshot(tree)
    with pytest.raises(InvalidArgumentError):
        tree.ledger.data(node, "kv")  # the anchor's data is the node's value
    with pytest.raises(InvalidArgumentError):
        tree.ledger.put(node, "swa", torch.arange(8))  # it holds its own: drop that first
    assert snapshot(tree) == before
    assert tree.ledger.drop(node, "swa") == 8 and tree.ledger.drop(node, "swa") == 0
    check_sizes(tree)


# ----- DSA and dense ------------------------------------------------------------------------
def test_dsa_sidecar_is_freed_with_its_owner() -> None:
    tree = make(PoolPreset.DSA)
    assert set(tree.allocators) == {"latent"}  # the indexer has no slots of its own
    slots = alloc(tree, "latent", 8)
    tree.insert(key(8), slots)
    match = tree.match_prefix(key(8))
    assert torch.equal(match.pool_indices["indexer"], slots)
    assert tree.ledger.size("indexer") == tree.ledger.size("latent") == 8
    assert tree.evict(8) == 8
    assert tree.ledger.size("indexer") == 0 and free_slots(tree, "latent") == 256


def test_dense_preset_behaves_like_radix_cache() -> None:
    tree = make(PoolPreset.DENSE)
    plain = RadixCache(RadixCacheConfig(page_size=PAGE), TokenSlotAllocator(256, PAGE))
    ops = [key(16), key(8), key(12, start=100), key(24), key(16, start=100)]
    for k in ops:
        for t in (tree, plain):
            t.insert(k, alloc(tree, "kv", len(k)) if t is tree else t.allocator.alloc(len(k)))
    for k in [*ops, key(4), key(40)]:
        a, b = tree.match_prefix(k), plain.match_prefix(k)
        assert a.prefix_len == b.prefix_len and torch.equal(a.device_indices, b.device_indices)
    assert (tree.total_nodes, tree.evictable_size) == (plain.total_nodes, plain.evictable_size)
    assert tree.evict(10) == plain.evict(10)
    assert sorted(n.length for n in tree.all_nodes()) == sorted(n.length for n in plain.all_nodes())


# ----- bad input ----------------------------------------------------------------------------
def snapshot(tree: ShadowRadixCache) -> Any:
    return (
        tree.total_nodes,
        tree.evictable_size,
        {name: (tree.ledger.size(name), tree.ledger.protected(name)) for name in tree.roles.extra},
        {name: a.available_size for name, a in tree.allocators.items()},
    )


@pytest.mark.parametrize(
    "pool_values",
    [
        {"nope": torch.zeros(8, dtype=torch.int64)},  # unknown pool
        {"kv": torch.zeros(8, dtype=torch.int64)},  # the anchor goes in ``value``
        {"swa": torch.arange(7)},  # wrong length
        {"swa": torch.tensor([-1, -1, 0, 1, 2, 3, 4, 5])},  # a page half held
        {"swa": torch.full((8,), -2)},  # not a slot
        {"swa": torch.zeros(8)},  # floats
        "swa",  # not a mapping
    ],
)
def test_bad_pool_values_raise_and_change_nothing(pool_values: Any) -> None:
    tree = make(PoolPreset.SWA)
    tree.insert_bundle(key(8), alloc(tree, "kv", 8), {"swa": swa_slots(tree, 8, 2)})
    before = snapshot(tree)
    with pytest.raises(InvalidArgumentError):
        tree.insert_bundle(key(8, start=50), torch.arange(8) + 100, pool_values)
    assert snapshot(tree) == before


def test_bad_calls_raise_and_change_nothing() -> None:
    tree = make(PoolPreset.HYBRID)
    tree.insert_bundle(key(8), alloc(tree, "kv", 8), {"conv": alloc(tree, "conv", 1)})
    node = tree.match_prefix(key(8)).last_device_node
    before = snapshot(tree)
    with pytest.raises(InvalidArgumentError):
        tree.insert_bundle(RadixKey(list(range(9))), torch.arange(9), {"conv": torch.tensor([3])})
    with pytest.raises(InvalidArgumentError):
        tree.insert_bundle(key(8, start=9), torch.arange(8), {"ssm": torch.tensor([3])})
    with pytest.raises(InvalidArgumentError):
        tree.ledger.unlock(node, "conv")  # below zero
    with pytest.raises(InvalidArgumentError):
        tree.ledger.lock(node, "kv")  # the anchor's lock is the tree lock
    with pytest.raises(InvalidArgumentError):
        tree.ledger.lock(node, "conv", pages=2)  # a snapshot takes no pages
    with pytest.raises(InvalidArgumentError):
        tree.evict_pool("nope", 1)
    with pytest.raises(InvalidArgumentError):
        tree.evict_pool("conv", -1)
    with pytest.raises(InvalidArgumentError):
        tree.ledger.size("nope")
    assert snapshot(tree) == before and tree.match_prefix(key(8)).prefix_len == 8


def test_bad_construction() -> None:
    pools = preset(PoolPreset.SWA, SHAPE)
    with pytest.raises(ConfigError):
        ShadowRadixCache(pools, {"kv": TokenSlotAllocator(16, PAGE)})  # swa missing
    with pytest.raises(ConfigError):
        ShadowRadixCache(
            preset(PoolPreset.DSA, SHAPE),
            {"latent": TokenSlotAllocator(16, PAGE), "indexer": TokenSlotAllocator(16, PAGE)},
        )
    with pytest.raises(ConfigError):
        ShadowRadixCache(
            pools,
            {"kv": TokenSlotAllocator(16, PAGE), "swa": TokenSlotAllocator(16, PAGE)},
            RadixCacheConfig(page_size=PAGE, simulated=True),
        )
    with pytest.raises(ConfigError):  # no ALL_PAGES pool to anchor the tree
        ShadowRadixCache(
            preset(PoolPreset.SWA, ModelShape(page_size=PAGE, full_layers=0)),
            {"swa": TokenSlotAllocator(16, PAGE)},
        )


# ----- random sequences: sizes stay exact -----------------------------------------------------
PAGES = st.lists(st.sampled_from([0, 1]), min_size=1, max_size=6)


class ShadowMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks and evictions; sizes and allocators always agree."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = make(PoolPreset.SWA)
        self.locks: list[tuple[Any, str | None]] = []

    @initialize(kind=st.sampled_from([PoolPreset.SWA, PoolPreset.HYBRID]))
    def setup(self, kind: PoolPreset) -> None:
        self.tree = make(kind, size=128)

    def key_of(self, pages: list[int]) -> RadixKey:
        return RadixKey([t for p in pages for t in [p, 7, 8, 9]])

    def extra(self, k: RadixKey, held: int) -> dict[str, torch.Tensor] | None:
        name = self.tree.roles.extra[0]
        if name == "swa":
            held = min(held, len(k) // PAGE)
            if self.tree.allocators["swa"].available_size < held * PAGE:
                return None
            return {"swa": swa_slots(self.tree, len(k), held)}
        if not held or self.tree.allocators["conv"].available_size < 1:
            return {}
        return {"conv": alloc(self.tree, "conv", 1)}

    @rule(pages=PAGES, held=st.integers(0, 6))
    def insert(self, pages: list[int], held: int) -> None:
        k = self.key_of(pages)
        extra = self.extra(k, held)
        kv = self.tree.allocators["kv"].alloc(len(k))
        if kv is None or extra is None:
            for name, slots in (extra or {}).items():
                self.tree.allocators[name].free(slots[slots >= 0])
            if kv is not None:
                self.tree.allocators["kv"].free(kv)
            return
        res = self.tree.insert_bundle(k, kv, extra)
        self.tree.allocators["kv"].free(kv[: res.already])
        for name, slots in res.unused.items():
            self.tree.allocators[name].free(slots)

    @rule(pages=PAGES)
    def match(self, pages: list[int]) -> None:
        k = self.key_of(pages)
        peeked, _ = self.tree.peek_prefix(k)
        m = self.tree.match_prefix(k)
        assert m.prefix_len == peeked and len(m.device_indices) == m.prefix_len
        assert sum(n.length for n in m.path) == m.prefix_len

    @rule(pages=PAGES, tree_lock=st.booleans(), pool_lock=st.booleans())
    def lock(self, pages: list[int], tree_lock: bool, pool_lock: bool) -> None:
        node = self.tree.match_prefix(self.key_of(pages)).last_device_node
        if node.parent is None:
            return
        if tree_lock:
            self.tree.inc_lock_ref(node)
            self.locks.append((node, None))
        if pool_lock:
            name = self.tree.roles.extra[0]
            self.tree.ledger.lock(node, name)
            self.locks.append((node, name))

    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        if not self.locks:
            return
        node, name = self.locks.pop(i % len(self.locks))
        if name is None:
            self.tree.dec_lock_ref(node)
        else:
            self.tree.ledger.unlock(node, name)

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        before = self.tree.evictable_size
        freed = self.tree.evict(n)
        assert self.tree.evictable_size == before - freed

    @rule(n=st.integers(0, 40))
    def evict_pool(self, n: int) -> None:
        name = self.tree.roles.extra[0]
        before = self.tree.ledger.evictable(name)
        freed = self.tree.evict_pool(name, n)
        assert freed >= min(n, before) and self.tree.ledger.evictable(name) == before - freed

    @invariant()
    def sizes_are_exact(self) -> None:
        check_sizes(self.tree)

    def teardown(self) -> None:
        for node, name in reversed(self.locks):
            if name is None:
                self.tree.dec_lock_ref(node)
            else:
                self.tree.ledger.unlock(node, name)
        self.tree.reset()
        assert all(a.available_size == a.size for a in self.tree.allocators.values())


TestShadowMachine = ShadowMachine.TestCase
TestShadowMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
