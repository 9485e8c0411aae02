"""CacheAwareRouter: prefix affinity, load margin, tie-breaks, pruning, namespaces, bad input."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from hicache.errors import ConfigError, InvalidArgumentError, InvalidTokenError
from hicache.keys import RadixKey
from hicache.scheduling.router import CacheAwareRouter, RouterConfig


def key(base: int, n: int = 32, tail: int | None = None, ns: str | None = None) -> RadixKey:
    tokens = list(range(base, base + n)) + ([] if tail is None else [tail])
    return RadixKey(tokens, extra_key=ns)


def router(n: int = 3, **kw: object) -> CacheAwareRouter:
    return CacheAwareRouter(n, RouterConfig(**kw))  # type: ignore[arg-type]


def test_a_repeated_prefix_goes_back_to_the_same_worker() -> None:
    r = router(3, balance_margin=1000)
    first = r.route(key(0, tail=1))
    assert first == 0  # all empty and idle: the lowest index
    assert r.route(key(500, tail=1)) == 1  # no match anywhere: the least loaded
    assert r.route(key(900, tail=1)) == 2
    for tail in (2, 3, 4):
        assert r.route(key(0, tail=tail)) == first
    assert r.route(key(500, tail=7)) == 1
    assert r.stats.routed == 7 and r.stats.cache_hits == 4 and r.stats.diverted == 0
    assert r.loads == (4 * 33.0, 2 * 33.0, 33.0)


def test_the_longest_match_wins_over_a_shorter_one() -> None:
    r = router(2, balance_margin=math.inf)
    r.route(key(0, n=8))  # worker 0 holds 8 tokens of the prefix
    r.report_load(0, 0)
    r.route(key(100))  # worker 1 gets something else first
    r.complete(1, 32, key=key(0, n=40))  # then finishes a 40-token sequence with that prefix
    assert r.route(key(0, n=40, tail=5)) == 1


def test_diverts_when_the_best_worker_exceeds_the_margin() -> None:
    r = router(2, balance_margin=100)
    assert r.route(key(0)) == 0
    r.report_load(0, 100)
    r.report_load(1, 0)
    assert r.route(key(0, tail=1)) == 0  # exactly at the margin: stays with the cache
    assert r.loads == (133.0, 0.0)
    assert r.route(key(0, tail=2)) == 1  # 133 - 0 > 100: diverted to the least loaded
    assert r.stats.diverted == 1
    # Worker 1 now has the prefix too; with both idle, the match tie goes to the lower index.
    r.report_load(0, 0)
    r.report_load(1, 0)
    assert r.route(key(0, tail=3)) == 0


def test_ties_go_to_lower_load_then_smaller_tree_then_lower_index() -> None:
    r = router(3, balance_margin=math.inf)
    r.report_load(0, 50)
    r.report_load(1, 10)
    r.report_load(2, 10)
    assert r.route(key(0)) == 1  # lower load among equal (zero) matches
    r.report_load(1, 10)
    assert r.route(key(100)) == 2  # equal load: worker 2's tree is empty
    r.report_load(2, 10)
    assert r.tree_size(1) == r.tree_size(2) == 32
    assert r.route(key(200)) == 1  # equal load and tree size: lower index


def test_trees_are_pruned_to_the_bound_least_recently_used_first() -> None:
    r = router(1, max_tree_tokens=100)
    for base in range(0, 1000, 100):
        r.route(key(base))  # 32 tokens each
        assert r.tree_size(0) <= 100
    tree = r.worker_tree(0)
    assert r.tree_size(0) == 96
    assert r.stats.pruned_tokens == 7 * 32
    assert tree.match_prefix(key(0)).prefix_len == 0  # the oldest went first
    assert tree.match_prefix(key(900)).prefix_len == 32


def test_pruning_keeps_the_recently_reused_prefix() -> None:
    r = router(1, max_tree_tokens=64)
    r.route(key(0))
    r.route(key(100))
    r.route(key(0, tail=1))  # refreshes key(0)'s path
    r.route(key(200))  # over the bound: key(100) is the least recently used
    tree = r.worker_tree(0)
    assert tree.match_prefix(key(100)).prefix_len == 0
    assert tree.match_prefix(key(0)).prefix_len == 32


def test_namespaces_never_match_across() -> None:
    r = router(2, balance_margin=math.inf)
    assert r.route(key(0, ns="tenant-a")) == 0
    # Same tokens, other namespace: no match, so it goes to the less loaded worker.
    assert r.route(key(0, ns="tenant-b")) == 1
    assert r.route(key(0)) == 0  # loads equal at 32 each: tie on zero match, equal trees
    assert r.worker_tree(1).match_prefix(key(0, ns="tenant-a")).prefix_len == 0
    assert r.worker_tree(0).match_prefix(key(0, ns="tenant-b")).prefix_len == 0
    assert r.worker_tree(0).match_prefix(key(0, ns="tenant-a")).prefix_len == 32


def test_page_size_only_whole_pages_match() -> None:
    r = router(2, page_size=16, balance_margin=math.inf)
    r.route(key(0, n=20))  # 16 tokens (one page) remembered on worker 0
    assert r.tree_size(0) == 16
    r.report_load(0, 1000)
    assert r.route(key(0, n=15)) == 1  # less than a page: no match, least loaded


def test_complete_subtracts_load_and_never_goes_negative() -> None:
    r = router(2)
    w = r.route(key(0), cost=500)
    assert r.loads[w] == 500
    r.complete(w, 200)
    assert r.loads[w] == 300
    r.complete(w, 1000)
    assert r.loads[w] == 0


def test_reset_worker_forgets_its_tree() -> None:
    r = router(2, balance_margin=math.inf)
    r.route(key(0))
    r.reset_worker(0)
    assert r.tree_size(0) == 0
    r.report_load(0, 0)
    r.report_load(1, 0)
    assert r.route(key(0, tail=1)) == 0  # nothing matches; tie broken by index
    assert r.stats.cache_hits == 0


def test_bad_input_raises_typed_and_changes_nothing() -> None:
    r = router(2)
    r.route(key(0))
    before = (r.loads, r.tree_size(0), r.tree_size(1), r.stats.routed)
    calls: list[Callable[[], object]] = [
        lambda: r.route([1, 2, 3]),  # type: ignore[arg-type]
        lambda: r.route(key(0), cost=-1),
        lambda: r.route(key(0), cost=float("nan")),
        lambda: r.report_load(2, 10),
        lambda: r.report_load(-1, 10),
        lambda: r.report_load(True, 10),
        lambda: r.report_load(0, -5),
        lambda: r.complete(5, 10),
        lambda: r.complete(0, 10, key=RadixKey([1, -2])),
        lambda: r.tree_size(9),
        lambda: r.reset_worker(2),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            call()
    with pytest.raises(InvalidTokenError):
        r.route(RadixKey([]))
    with pytest.raises(InvalidTokenError):
        r.route(RadixKey([5, 2**32]))
    assert (r.loads, r.tree_size(0), r.tree_size(1), r.stats.routed) == before


def test_config_errors() -> None:
    cases: list[dict[str, object]] = [
        {"balance_margin": -1},
        {"balance_margin": float("nan")},
        {"max_tree_tokens": 0},
        {"page_size": 0},
        {"page_size": 64, "max_tree_tokens": 32},
        {"host_hit_weight": -0.5},
        {"host_hit_weight": 1.5},
        {"host_hit_weight": float("nan")},
        {"host_hit_weight": "1"},
        {"device_tree_tokens": -1},
        {"device_tree_tokens": 1.5},
    ]
    for bad in cases:
        with pytest.raises(ConfigError):
            RouterConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        CacheAwareRouter(0)


# ----- device and host ------------------------------------------------------------------------
def _worker_with_prefix_on_host(**kw: object) -> CacheAwareRouter:
    """Worker 0 cached a 64-token prefix long ago (its device has room for 64 tokens and has
    cached two other sequences since: the prefix is on its host); worker 1 holds 16 tokens of
    it on its device."""
    r = router(2, balance_margin=math.inf, device_tree_tokens=64, max_tree_tokens=1024, **kw)
    r.complete(0, 0, key=key(0, n=64))
    r.complete(0, 0, key=key(1000, n=64))
    r.complete(0, 0, key=key(2000, n=64))
    r.complete(1, 0, key=key(0, n=16))
    return r


def test_the_request_goes_to_the_worker_holding_its_prefix_on_host() -> None:
    # Worker 0: 64 host tokens x 0.8 = 51.2; worker 1: 16 device tokens.
    r = _worker_with_prefix_on_host()
    assert r.route(key(0, n=64, tail=1)) == 0
    assert r.stats.cache_hits == 1
    # What the request brought is on worker 0's device now: a follow-up goes there too.
    assert r.route(key(0, n=64, tail=2)) == 0


def test_a_host_hit_counts_at_the_configured_weight() -> None:
    # 64 x 0.2 = 12.8 < 16 on worker 1's device; at 0 the host tier is nothing.
    for weight in (0.0, 0.2):
        r = _worker_with_prefix_on_host(host_hit_weight=weight)
        assert r.route(key(0, n=64, tail=1)) == 1, weight
    r = _worker_with_prefix_on_host(host_hit_weight=0.3)  # 19.2 > 16
    assert r.route(key(0, n=64, tail=1)) == 0


def test_without_a_device_size_the_whole_tree_counts_as_device() -> None:
    r = router(2, balance_margin=math.inf, host_hit_weight=0.0)
    r.complete(0, 0, key=key(0, n=64))
    r.complete(0, 0, key=key(1000, n=64))
    r.complete(1, 0, key=key(0, n=16))
    assert r.route(key(0, n=64, tail=1)) == 0  # 64 "device" tokens, whatever the weight
