"""ShadowRadixCache over the dsv4 pools: three lifecycles (``c4`` with its indexer, ``c128``,
``swa``) on one tree. Each pool's eviction leaves the others' slots allocated and their data on
the nodes; a hit needs ``c4`` and ``c128`` on every page and ``swa`` on the window's."""

from __future__ import annotations

import pytest
import torch

from hicache.errors import ConfigError
from hicache.keys import RadixKey
from hicache.pools import ModelShape, PoolPreset, TokenSlotAllocator, preset
from hicache.pools.pool_spec import HitRuleKind
from hicache.radix.node import TreeNode
from hicache.radix.shadow import ShadowRadixCache

PAGE = 128  # dsv4: a page holds whole 128:1 groups
WINDOW = PAGE  # the swa window: one page
OWNERS = ("c4", "c128", "swa")


def make(pages: int = 8) -> ShadowRadixCache:
    pools = preset(PoolPreset.DSV4, ModelShape(page_size=PAGE, window=WINDOW))
    return ShadowRadixCache(
        pools, {name: TokenSlotAllocator(pages * PAGE, PAGE) for name in OWNERS}
    )


def key(pages: int) -> RadixKey:
    return RadixKey(list(range(pages * PAGE)))


def used(tree: ShadowRadixCache) -> dict[str, int]:
    return {name: a.size - a.available_size for name, a in tree.allocators.items()}


def alloc(tree: ShadowRadixCache, pool: str, n: int) -> torch.Tensor:
    slots = tree.allocators[pool].alloc(n)
    assert slots is not None
    return slots


def cache(tree: ShadowRadixCache, pages: int) -> dict[str, torch.Tensor]:
    """Commit ``key(pages)`` as a finished request does: c4 and c128 slots for every token, swa
    for the window before the end; free what the tree did not keep. Returns the slots given."""
    n = pages * PAGE
    given = {"c4": alloc(tree, "c4", n), "c128": alloc(tree, "c128", n)}
    swa = torch.full((n,), -1, dtype=torch.int64)
    swa[n - WINDOW :] = alloc(tree, "swa", WINDOW)
    result = tree.insert_bundle(key(pages), given["c4"], {"c128": given["c128"], "swa": swa})
    tree.allocators["c4"].free(given["c4"][: result.already])
    for name, unused in result.unused.items():
        if len(unused):
            tree.allocators[name].free(unused)
    return {**given, "swa": swa}


def nodes_by_end(tree: ShadowRadixCache) -> dict[int, TreeNode]:
    """Every node by the token where it ends."""
    return {sum(n.length for n in node.path_to_root()): node for node in tree.all_nodes()}


def check_counts(tree: ShadowRadixCache) -> None:
    """Each allocator holds exactly what the nodes hold of its pool."""
    nodes = tree.all_nodes()
    held = {name: 0 for name in OWNERS}
    for node in nodes:
        held["c4"] += 0 if node.value is None else len(node.value)
        for name in ("c128", "swa"):
            data = tree.ledger.data(node, name)
            held[name] += 0 if data is None else len(data)
    assert used(tree) == held
    assert {name: tree.ledger.size(name) for name in OWNERS} == held
    assert tree.ledger.size("indexer") == held["c4"]  # on c4's slots


def test_three_lifecycles() -> None:
    tree = make()
    roles = tree.roles
    assert roles.anchor == "c4" and roles.token_pools == ("c128", "swa")
    assert roles.windows == ("swa",) and roles.owner_of["indexer"] == "c4"
    assert roles.rules["c128"].kind is HitRuleKind.ALL_PAGES
    assert roles.rules["swa"].kind is HitRuleKind.TRAILING_PAGES
    pools = preset(PoolPreset.DSV4, ModelShape(page_size=PAGE, window=WINDOW))
    with pytest.raises(ConfigError, match="c128"):  # c128 needs an allocator of its own
        ShadowRadixCache(pools, {n: TokenSlotAllocator(PAGE, PAGE) for n in ("c4", "swa")})


@pytest.mark.parametrize("pool", OWNERS)
def test_one_pools_eviction_leaves_the_others(pool: str) -> None:
    tree = make()
    cache(tree, 1)
    (node,) = tree.all_nodes()
    before = used(tree)
    kept = {name: tree.ledger.data(node, name) for name in ("c128", "swa")}
    anchor = node.value
    freed = tree.evict(PAGE) if pool == "c4" else tree.evict_pool(pool, PAGE)
    assert freed == before[pool] == PAGE and used(tree)[pool] == 0
    others = [name for name in OWNERS if name != pool]
    assert {n: used(tree)[n] for n in others} == {n: before[n] for n in others}
    assert tree.all_nodes() == [node]  # the node stays with what the others hold
    for name, data in kept.items():
        if name != pool:
            assert tree.ledger.data(node, name) is data
    assert pool == "c4" or node.value is anchor
    assert tree.match_prefix(key(1)).prefix_len == 0  # every pool is needed for a hit
    check_counts(tree)
    # A request computes it again: the pool that lost it takes the new slots, the others keep
    # theirs (the duplicates go back), and the prefix is a hit again.
    given = cache(tree, 1)
    assert used(tree) == before
    match = tree.match_prefix(key(1))
    assert match.prefix_len == PAGE and tree.all_nodes() == [node]
    for name in ("c128", "swa"):
        want = given[name] if name == pool else kept[name]
        assert want is not None and torch.equal(match.pool_indices[name], want)
    assert torch.equal(match.device_indices, given["c4"] if pool == "c4" else anchor)
    check_counts(tree)


def _two_commits() -> tuple[ShadowRadixCache, dict[int, TreeNode]]:
    """Pages 0-1 committed, then pages 0-2: nodes end at 1, 2 and 3 pages (an insert cuts
    where the swa window starts), the last two with their window's swa page."""
    tree = make()
    cache(tree, 2)
    cache(tree, 3)
    ends = nodes_by_end(tree)
    assert sorted(ends) == [PAGE, 2 * PAGE, 3 * PAGE]
    assert [tree.ledger.data(ends[e], "swa") is not None for e in sorted(ends)] == [0, 1, 1]
    assert tree.match_prefix(key(3)).prefix_len == 3 * PAGE
    assert tree.match_prefix(key(2)).prefix_len == 2 * PAGE
    return tree, ends


@pytest.mark.parametrize("pool", OWNERS)
def test_an_evicted_last_page_backs_the_hit_off_to_the_page_before(pool: str) -> None:
    tree, ends = _two_commits()  # the key(2) match used the upper nodes last
    freed = tree.evict(PAGE) if pool == "c4" else tree.evict_pool(pool, 1)
    assert freed == PAGE and nodes_by_end(tree) == ends
    assert tree.match_prefix(key(3)).prefix_len == 2 * PAGE
    check_counts(tree)


@pytest.mark.parametrize(
    ("pool", "end", "hits"), [("c128", PAGE, (0, 0)), ("swa", 2 * PAGE, (0, 3))]
)
def test_a_hole_ends_an_all_pages_hit_and_a_window_needs_only_its_pages(
    pool: str, end: int, hits: tuple[int, int]
) -> None:
    """c128 without page 0: no hit at all. swa without page 1: the 2-page prefix lacks its
    window, the 3-page one has it."""
    tree, ends = _two_commits()
    tree.ledger.drop(ends[end], pool)
    assert tree.match_prefix(key(2)).prefix_len == hits[0] * PAGE
    assert tree.match_prefix(key(3)).prefix_len == hits[1] * PAGE
    check_counts(tree)


def test_pool_locks_hold_their_own_pool_only() -> None:
    """The two counters: the tree lock holds the anchor, a pool lock its pool's data; neither
    holds another pool's."""
    tree = make()
    cache(tree, 2)
    node = tree.match_prefix(key(2)).last_device_node
    tree.inc_lock_ref(node)
    tree.ledger.lock(node, "c128")
    assert tree.evict(4 * PAGE) == 0  # tree-locked
    assert tree.evict_pool("c128", 4 * PAGE) == 0  # pool-locked
    assert tree.evict_pool("swa", 4 * PAGE) == PAGE  # neither lock is swa's
    tree.dec_lock_ref(node)
    assert tree.evict(4 * PAGE) == 2 * PAGE and tree.ledger.protected("c128") == 2 * PAGE
    tree.ledger.unlock(node, "c128")
    assert len(tree.all_nodes()) == 2  # c128 is still there
    assert tree.evict_pool("c128", 4 * PAGE) == 2 * PAGE
    assert tree.all_nodes() == [] and used(tree) == dict.fromkeys(OWNERS, 0)


def test_a_node_leaves_once_no_pool_holds_anything_there() -> None:
    tree, _ = _two_commits()
    assert tree.evict(10 * PAGE) == 3 * PAGE  # c4 everywhere: the nodes stay, anchor-less
    assert len(tree.all_nodes()) == 3 and used(tree)["c4"] == 0
    assert tree.evict_pool("swa", 10 * PAGE) == 2 * PAGE
    # c128 node by node, least recently used first (the leaf, then the root's child): a node
    # left with nothing goes, unless a child hangs under it; then it goes with the child.
    for count in (2, 2):
        assert tree.evict_pool("c128", 1) == PAGE and len(tree.all_nodes()) == count
    assert tree.evict_pool("c128", 1) == PAGE
    assert tree.all_nodes() == [] and used(tree) == dict.fromkeys(OWNERS, 0)
    check_counts(tree)
