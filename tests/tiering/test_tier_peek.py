"""HiRadixCache.peek_tiers: what match_prefix finds on device and host, without touching the tree.

Every peek is checked against the real match on the same tree (device hit = ``prefix_len``,
host hit = ``host_hit_length``), over every pool preset's hit rules, with prefixes on the
device, on host and partly on both; and the peek must leave every node as it was.
"""

from __future__ import annotations

import pytest
from pool_kit import WINDOW, PoolKit
from tier_kit import PAGE

from hicache.keys import RadixKey
from hicache.pools.presets import PoolPreset
from hicache.radix.node import TreeNode
from hicache.tiering.cache import HiRadixCache


def _tokens(n: int, base: int = 0) -> list[int]:
    return [base + 7 * i + 1 for i in range(n)]


def _state(tree: HiRadixCache) -> list[tuple[object, ...]]:
    """Everything a peek must not change: the nodes, their spans, hits, ages and tiers."""
    return sorted(
        (n.id, n.key, n.length, n.hit_count, n.last_access_time, n.access_tick,
         n.value is None, n.host_value is None)
        for n in tree.all_nodes()
    )  # fmt: skip


def _agrees(tree: HiRadixCache, tokens: list[int], ns: str | None = None) -> tuple[int, int]:
    """Peek ``tokens``, check the tree is untouched and the match finds the same; (device,
    host) tokens."""
    key = RadixKey(tokens, ns)
    before = _state(tree)
    peek = tree.peek_tiers(key)
    assert _state(tree) == before, "a peek changed the tree"
    match = tree.match_prefix(key, count_hits=False)
    assert (peek.device, peek.host) == (match.prefix_len, match.host_hit_length), tokens
    # The match may have split the node the peek ended inside: the peek's node is then the
    # lower half, right under the match's.
    if peek.total:
        end = match.last_host_node
        assert end is not None and peek.last_node in (end, *end.children.values())
    if peek.device:
        end = match.last_device_node
        assert peek.last_device_node in (end, *end.children.values())
    else:
        assert peek.last_device_node is None
    return peek.device, peek.host


def _queries(cached: list[int], base: int) -> list[list[int]]:
    """Every whole-page prefix of ``cached`` with a foreign tail, and some that end mid-page."""
    out = [[*cached[:n], *_tokens(PAGE + 1, base)] for n in range(0, len(cached) + 1, PAGE)]
    out += [cached[: n + 2] for n in range(0, len(cached), PAGE)]
    return [q for q in out if q]


def _depth(node: TreeNode | None) -> int:
    return sum(n.length for n in node.path_to_root()) if node is not None else 0


async def test_dense_peek_agrees_with_the_match_on_device_host_and_both() -> None:
    async with await PoolKit.build(PoolPreset.DENSE, sizes={"kv": 64}) as kit:
        first, second = _tokens(24), [*_tokens(8), *_tokens(16, base=500)]
        kit.cache(first)
        kit.cache(second)
        assert kit.tree.evict(32) == 32  # the two leaves go to host; the shared 8 stay
        assert _agrees(kit.tree, [*first, 99]) == (8, 16)
        assert _agrees(kit.tree, [*second, 99]) == (8, 16)
        for query in _queries(first, 9000) + _queries(second, 9500):
            _agrees(kit.tree, query)
        assert _agrees(kit.tree, [*first, 99], ns="other") == (0, 0)
        kit.tree.evict(10_000)  # all of it on host now
        peek = kit.tree.peek_tiers(RadixKey([*first, 99]))
        assert (peek.device, peek.host) == (0, 24) and _depth(peek.last_node) == 24
        for query in _queries(first, 9000):
            _agrees(kit.tree, query)


@pytest.mark.parametrize("kind", [PoolPreset.SWA, PoolPreset.HYBRID, PoolPreset.DSA])
async def test_peek_applies_every_pools_hit_rule_as_the_match_does(kind: PoolPreset) -> None:
    async with await PoolKit.build(kind) as kit:
        tokens = _tokens(32)
        kit.cache(tokens, snapshots=(16,) if kind is PoolPreset.HYBRID else ())
        for query in _queries(tokens, 7000):
            _agrees(kit.tree, query)
        kit.tree.evict(10_000)  # every pool's data to host (write-through backed it up)
        device, host = _agrees(kit.tree, [*tokens, 99])
        assert (device, host) == (0, 32)
        for query in _queries(tokens, 7000):
            _agrees(kit.tree, query)


async def test_a_window_only_on_host_makes_the_whole_prefix_a_host_hit() -> None:
    async with await PoolKit.build(PoolPreset.SWA) as kit:
        tokens = _tokens(24)
        kit.cache(tokens)
        assert kit.tree.evict_pool("swa", 1) == WINDOW  # the anchor stays on the device
        assert _agrees(kit.tree, [*tokens, 5]) == (0, 24)
        # Its anchor alone is on the device: the plain tree's peek would call it all cached.
        assert kit.tree.peek_prefix(RadixKey([*tokens, 5])) == (0, None)
