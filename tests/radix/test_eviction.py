"""Each eviction policy's order on hand-made cases (fake clock, one leaf per sequence)."""

from __future__ import annotations

import pytest
from clock_kit import FakeClock

from hicache.keys import RadixKey
from hicache.radix import EvictionPolicy, RadixCache, RadixCacheConfig


def tree_with(policy: EvictionPolicy, **extra: object) -> tuple[RadixCache, FakeClock]:
    clock = FakeClock()
    config = RadixCacheConfig(page_size=1, policy=policy, simulated=True, **extra)  # type: ignore[arg-type]
    return RadixCache(config, clock=clock), clock


def eviction_order(tree: RadixCache) -> list[int]:
    """First token of each sequence in the order evict(1) removes them."""
    order = []
    while tree.total_size:
        before = {n.key[:4]: n for n in tree.all_nodes()}
        tree.evict(1)
        after = {n.key[:4] for n in tree.all_nodes()}
        (gone,) = set(before) - after
        order.append(int.from_bytes(gone, "little"))
    return order


def build(policy: EvictionPolicy) -> tuple[RadixCache, FakeClock]:
    """Sequences 10, 20, 30, created at t=1, 2, 3; then 10 used at t=4 (twice), 30 at t=5."""
    tree, clock = tree_with(policy)
    for t, first in ((1, 10), (2, 20), (3, 30)):
        clock.now = t
        tree.insert(RadixKey([first, first + 1]), priority={10: 5, 20: 1, 30: 3}[first])
    clock.now = 4
    tree.match_prefix(RadixKey([10, 11]))
    tree.match_prefix(RadixKey([10, 11]))
    clock.now = 5
    tree.match_prefix(RadixKey([30, 31]))
    return tree, clock


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (EvictionPolicy.LRU, [20, 10, 30]),  # last used 2, 4, 5
        (EvictionPolicy.MRU, [30, 10, 20]),
        (EvictionPolicy.FIFO, [10, 20, 30]),  # created 1, 2, 3
        (EvictionPolicy.FILO, [30, 20, 10]),
        (EvictionPolicy.LFU, [20, 30, 10]),  # hits 0, 1, 2
        (EvictionPolicy.PRIORITY, [20, 30, 10]),  # priorities 1, 3, 5
    ],
)
def test_policy_order(policy: EvictionPolicy, expected: list[int]) -> None:
    tree, _ = build(policy)
    assert eviction_order(tree) == expected


def test_lfu_breaks_ties_by_recency() -> None:
    tree, clock = tree_with(EvictionPolicy.LFU)
    for t, first in ((1, 10), (2, 20)):
        clock.now = t
        tree.insert(RadixKey([first]))
    clock.now = 3
    tree.match_prefix(RadixKey([20]))
    clock.now = 4
    tree.match_prefix(RadixKey([10]))
    assert eviction_order(tree) == [20, 10]  # one hit each; 20 was used longer ago


def test_same_timestamp_is_ordered_by_access() -> None:
    tree, _ = tree_with(EvictionPolicy.LRU)  # the clock never moves
    for first in (10, 20, 30):
        tree.insert(RadixKey([first]))
    tree.match_prefix(RadixKey([10]))
    assert eviction_order(tree) == [20, 30, 10]


def test_slru_evicts_probation_before_protected_and_bounds_protected() -> None:
    tree, clock = tree_with(EvictionPolicy.SLRU, slru_protected_share=0.5)
    for t, first in ((1, 10), (2, 20), (3, 30), (4, 40)):
        clock.now = t
        tree.insert(RadixKey([first, first + 1]))
    clock.now = 5
    tree.match_prefix(RadixKey([10, 11]))  # promoted
    # 10 is protected: probation 20, 30, 40 go first, oldest first.
    order = eviction_order(tree)
    assert order[:3] == [20, 30, 40] and order[3] == 10

    tree, clock = tree_with(EvictionPolicy.SLRU, slru_protected_share=0.5)
    for t, first in ((1, 10), (2, 20), (3, 30), (4, 40)):
        clock.now = t
        tree.insert(RadixKey([first, first + 1]))
    for t, first in ((5, 10), (6, 20), (7, 30)):  # three promotions into a 4-token segment
        clock.now = t
        tree.match_prefix(RadixKey([first, first + 1]))
    protected = {int.from_bytes(n.key[:4], "little") for n in tree.all_nodes() if n.protected}
    assert protected == {20, 30}  # 10, the oldest protected, was demoted to probation
    assert eviction_order(tree) == [40, 10, 20, 30]


def test_a_parent_becomes_evictable_when_its_last_child_goes() -> None:
    tree, clock = tree_with(EvictionPolicy.LRU)
    clock.now = 1
    tree.insert(RadixKey([1, 2, 3]))
    clock.now = 2
    tree.insert(RadixKey([1, 2, 4]))
    clock.now = 3
    tree.insert(RadixKey([9]))
    # Leaves: [3] (t=1), [4] (t=2), [9] (t=3); [1, 2] is internal (touched at t=2).
    assert tree.evict(1) == 1 and tree.match_prefix(RadixKey([1, 2, 3])).prefix_len == 2
    assert tree.evict(1) == 1  # [4] (t=2)
    # [9] and [1, 2] were both last used at t=3, [1, 2] later (the match just above).
    assert tree.evict(1) == 1
    assert tree.match_prefix(RadixKey([9])).prefix_len == 0
    assert tree.evict(1) == 2 and tree.total_size == 0
