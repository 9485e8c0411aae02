"""RadixCache: matching, inserting, splitting, namespaces, locks and bad input."""

from __future__ import annotations

import pytest
import torch

from hicache.errors import InvalidArgumentError, InvalidTokenError
from hicache.keys import RadixKey
from hicache.radix import RadixCache, RadixCacheConfig


def sim(page_size: int = 1) -> RadixCache:
    return RadixCache(RadixCacheConfig(page_size=page_size, simulated=True))


def sizes(tree: RadixCache) -> tuple[int, int, int]:
    nodes = tree.all_nodes()
    locked = sum(n.length for n in nodes if n.lock_ref > 0)
    return sum(n.length for n in nodes), locked, tree.evictable_size + tree.protected_size


def test_match_is_the_longest_cached_prefix_and_splits_exactly() -> None:
    tree = sim()
    assert tree.insert(RadixKey([1, 2, 3, 4, 5])) == 0
    match = tree.match_prefix(RadixKey([1, 2, 3, 9]))
    assert match.prefix_len == 3
    node = match.last_device_node
    assert node.length == 3 and len(node.children) == 1
    (rest,) = node.children.values()
    assert rest.length == 2 and rest.parent is node
    # The next match of the same prefix is a straight walk to the split node.
    again = tree.match_prefix(RadixKey([1, 2, 3, 7]))
    assert again.last_device_node is node and tree.total_nodes == 2


def test_insert_returns_what_was_there_and_adds_only_the_suffix() -> None:
    tree = sim()
    assert tree.insert(RadixKey([1, 2, 3, 4])) == 0
    assert tree.insert(RadixKey([1, 2, 3, 4, 5, 6])) == 4
    assert tree.insert(RadixKey([1, 2, 7])) == 2
    assert tree.total_size == 7  # 1 2 | 3 4 | 5 6 | 7
    assert sorted(n.length for n in tree.all_nodes()) == [1, 2, 2, 2]
    assert tree.insert(RadixKey([1, 2, 3, 4, 5, 6])) == 6


def test_page_alignment() -> None:
    tree = sim(page_size=4)
    assert tree.insert(RadixKey(list(range(10)))) == 0
    assert tree.total_size == 8  # the partial tail page is never cached
    assert tree.match_prefix(RadixKey([0, 1, 2, 3, 4, 5, 9, 9])).prefix_len == 4
    assert tree.match_prefix(RadixKey([0, 1, 2])).prefix_len == 0
    assert tree.match_prefix(RadixKey([0, 1, 2, 9])).prefix_len == 0
    # A split lands on a page boundary even when the mismatch is mid-page.
    assert tree.insert(RadixKey([0, 1, 2, 3, 4, 5, 6, 99])) == 4
    assert sorted(n.length for n in tree.all_nodes()) == [4, 4, 4]


def test_long_spans_split_at_the_first_differing_page() -> None:
    tree = sim(page_size=16)
    base = list(range(16 * 40))
    tree.insert(RadixKey(base))
    for diverge_page in (1, 2, 17, 39):
        probe = base.copy()
        probe[diverge_page * 16 + 5] = 10**6
        assert tree.match_prefix(RadixKey(probe)).prefix_len == diverge_page * 16


def test_namespaces_never_share() -> None:
    tree = sim()
    tree.insert(RadixKey([1, 2, 3], "tenant-a"))
    assert tree.match_prefix(RadixKey([1, 2, 3], "tenant-b")).prefix_len == 0
    assert tree.match_prefix(RadixKey([1, 2, 3])).prefix_len == 0
    assert tree.match_prefix(RadixKey([1, 2, 3], "tenant-a")).prefix_len == 3
    tree.insert(RadixKey([1, 2, 3], "tenant-b"))
    assert tree.total_size == 6


def test_bigram_keys_match_on_pairs() -> None:
    tree = sim()
    tree.insert(RadixKey([1, 2, 3, 4], is_bigram=True))  # units (1,2) (2,3) (3,4)
    assert tree.match_prefix(RadixKey([1, 2, 3, 9], is_bigram=True)).prefix_len == 2
    assert tree.match_prefix(RadixKey([1, 2, 3, 4], is_bigram=False)).prefix_len == 0
    assert tree.match_prefix(RadixKey([2, 3, 4], is_bigram=True)).prefix_len == 0


def test_values_follow_splits_and_matches_concatenate_them() -> None:
    tree = RadixCache(RadixCacheConfig(page_size=2))
    tree.insert(RadixKey([1, 2, 3, 4, 5, 6]), torch.arange(100, 106))
    tree.insert(RadixKey([1, 2, 3, 4, 9, 9]), torch.arange(200, 206))
    match = tree.match_prefix(RadixKey([1, 2, 3, 4, 9, 9, 7]))
    assert match.device_indices.tolist() == [100, 101, 102, 103, 204, 205]
    assert tree.match_prefix(RadixKey([1, 2, 3, 4, 5, 6])).device_indices.tolist() == list(
        range(100, 106)
    )


def test_hash_values_split_with_the_node() -> None:
    tree = sim(page_size=2)
    tree.insert(RadixKey([1, 2, 3, 4, 5, 6]))
    (node,) = tree.all_nodes()
    node.hash_value = [b"a" * 32, b"b" * 32, b"c" * 32]
    upper = tree.match_prefix(RadixKey([1, 2, 3, 4, 0, 0])).last_device_node
    assert upper.hash_value == [b"a" * 32, b"b" * 32]
    assert node.hash_value == [b"c" * 32]


def test_locks_keep_sizes_exact_and_survive_splits() -> None:
    tree = sim()
    tree.insert(RadixKey([1, 2, 3, 4, 5]))
    leaf = tree.match_prefix(RadixKey([1, 2, 3, 4, 5])).last_device_node
    tree.inc_lock_ref(leaf)
    assert (tree.evictable_size, tree.protected_size) == (0, 5)
    split = tree.match_prefix(RadixKey([1, 2, 9])).last_device_node  # splits the locked node
    assert split.lock_ref == 1 and leaf.lock_ref == 1
    total, locked, reported = sizes(tree)
    assert total == reported == 5 and locked == tree.protected_size == 5
    assert tree.evict(100) == 0  # everything is locked
    tree.dec_lock_ref(leaf)
    assert (tree.evictable_size, tree.protected_size) == (5, 0)
    assert tree.evict(1) == 3 and tree.evict(1) == 2 and tree.total_size == 0


def test_dec_lock_ref_below_zero_raises_and_changes_nothing() -> None:
    tree = sim()
    tree.insert(RadixKey([1, 2, 3]))
    node = tree.match_prefix(RadixKey([1, 2, 3])).last_device_node
    with pytest.raises(InvalidArgumentError):
        tree.dec_lock_ref(node)
    assert node.lock_ref == 0 and tree.evictable_size == 3 and tree.protected_size == 0


def test_eviction_never_touches_a_locked_path_and_parents_follow_children() -> None:
    tree = sim()
    tree.insert(RadixKey([1, 2, 3, 4]))
    tree.insert(RadixKey([1, 2, 5, 6]))
    keep = tree.match_prefix(RadixKey([1, 2, 3, 4])).last_device_node
    tree.inc_lock_ref(keep)
    assert tree.evict(100) == 2  # only [5, 6]; [1, 2] is on the locked path
    assert tree.match_prefix(RadixKey([1, 2, 3, 4])).prefix_len == 4
    tree.dec_lock_ref(keep)
    assert tree.evict(100) == 4 and tree.total_nodes == 0


def test_evict_frees_whole_nodes_and_reports_exactly() -> None:
    tree = sim()
    tree.insert(RadixKey(list(range(10))))
    tree.insert(RadixKey([100, 101]))
    before = tree.total_size
    freed = tree.evict(1)
    assert freed in (2, 10) and tree.total_size == before - freed


def test_pins_hold_until_expiry_or_unpin() -> None:
    now = [0.0]
    tree = RadixCache(RadixCacheConfig(simulated=True), clock=lambda: now[0])
    tree.insert(RadixKey([1, 2, 3]))
    tree.insert(RadixKey([7, 8]))
    node = tree.pin(RadixKey([1, 2, 3]), ttl_s=10)
    assert node is not None
    assert tree.evict(100) == 2
    now[0] = 11.0
    assert tree.evict(100) == 3
    tree.insert(RadixKey([4, 5]))
    pinned = tree.pin(RadixKey([4, 5]), ttl_s=10)
    assert pinned is not None
    tree.unpin(pinned)
    assert tree.evict(100) == 2
    assert tree.pin(RadixKey([9]), ttl_s=1) is None
    with pytest.raises(InvalidArgumentError):
        tree.unpin(pinned)


@pytest.mark.parametrize("tokens", [[], [-1], [2**32], [1.5], ["x"], [None]], ids=lambda t: repr(t))
def test_bad_tokens_raise_and_leave_the_tree_unchanged(tokens: list[object]) -> None:
    tree = sim()
    tree.insert(RadixKey([1, 2, 3]))
    with pytest.raises(InvalidTokenError):
        tree.insert(RadixKey(tokens))  # type: ignore[arg-type]
    with pytest.raises(InvalidTokenError):
        tree.match_prefix(RadixKey(tokens))  # type: ignore[arg-type]
    assert tree.total_size == 3 and tree.total_nodes == 1


def test_bad_arguments_raise() -> None:
    tree = RadixCache(RadixCacheConfig(page_size=1))
    with pytest.raises(InvalidArgumentError):
        tree.insert(RadixKey([1, 2, 3]), torch.arange(2))  # value shorter than the key
    with pytest.raises(InvalidArgumentError):
        tree.insert(RadixKey([1, 2, 3]))  # a non-simulated tree needs the slots
    with pytest.raises(InvalidArgumentError):
        tree.evict(-1)
    with pytest.raises(InvalidArgumentError):
        tree.match_prefix([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        RadixCacheConfig(page_size=0)
    assert tree.total_nodes == 0


def test_peek_prefix_touches_nothing() -> None:
    tree = sim(page_size=2)
    tree.insert(RadixKey([1, 2, 3, 4, 5, 6]))
    (node,) = tree.all_nodes()
    stamp = (node.hit_count, node.last_access_time, node.access_tick, tree.total_nodes)
    assert tree.peek_prefix(RadixKey([1, 2, 3, 4, 9, 9])) == (4, node)
    assert tree.peek_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7, 8])) == (6, node)
    assert tree.peek_prefix(RadixKey([1, 2], "other-tenant")) == (0, None)
    assert tree.namespace_root("other-tenant") is None
    assert (node.hit_count, node.last_access_time, node.access_tick, tree.total_nodes) == stamp
    assert tree.match_prefix(RadixKey([1, 2, 3, 4, 9, 9])).prefix_len == 4  # now it splits


def test_misses_and_sub_page_inserts_leave_no_namespace_behind() -> None:
    tree = sim(page_size=4)
    for i in range(50):
        assert tree.match_prefix(RadixKey([1, 2, 3, 4], f"salt-{i}")).prefix_len == 0
        assert tree.insert(RadixKey([1, 2], f"salt-{i}")) == 0
    assert all(tree.namespace_root(f"salt-{i}") is None for i in range(50))
    miss = tree.match_prefix(RadixKey([1, 2, 3, 4], "x"))
    tree.inc_lock_ref(miss.last_device_node)  # locking a miss is harmless
    tree.dec_lock_ref(miss.last_device_node)
    assert tree.total_size == 0 and tree.protected_size == 0


def test_keys_of_any_int_sequence_agree() -> None:
    import array

    import numpy as np

    tree = sim(page_size=2)
    tree.insert(RadixKey([5, 6, 7, 8]))
    for tokens in ((5, 6, 7, 9), array.array("I", [5, 6, 7, 9]), np.array([5, 6, 7, 9])):
        assert tree.match_prefix(RadixKey(tokens)).prefix_len == 2  # type: ignore[arg-type]
