"""PrefixScheduler policies, in-batch prefix sharing, LPM fallback, PrefillDelayer, bad input."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from clock_kit import FakeClock
from tiered_tree_kit import tiered_with

from hicache.errors import ConfigError, InvalidArgumentError, InvalidTokenError
from hicache.keys import RadixKey
from hicache.radix import RadixCache, RadixCacheConfig
from hicache.scheduling.request import WaitingRequest
from hicache.scheduling.scheduler import (
    DelayerConfig,
    PrefillDelayer,
    PrefixScheduler,
    QueueStats,
    SchedulePolicy,
    SchedulerConfig,
)

P = SchedulePolicy


def sim(page_size: int = 1) -> RadixCache:
    return RadixCache(RadixCacheConfig(page_size=page_size, simulated=True))


def req(
    rid: str, tokens: Sequence[int], t: float = 0.0, out: int = 16, ns: str | None = None
) -> WaitingRequest:
    return WaitingRequest(rid, RadixKey(list(tokens), extra_key=ns), out, t)


def rids(requests: Sequence[WaitingRequest]) -> list[str]:
    return [str(r.rid) for r in requests]


def sched(tree: RadixCache | None, policy: SchedulePolicy, **kw: object) -> PrefixScheduler:
    return PrefixScheduler(tree, SchedulerConfig(policy=policy, **kw))  # type: ignore[arg-type]


# ----- cache-agnostic policies ----------------------------------------------------------------
def test_fcfs_orders_by_arrival_time_stably() -> None:
    queue = [req("c", [1], t=3.0), req("a", [2], t=1.0), req("b", [3], t=2.0), req("d", [4], 1.0)]
    assert rids(sched(sim(), P.FCFS).order(queue)) == ["a", "d", "b", "c"]


def test_lof_orders_by_max_new_tokens_then_arrival() -> None:
    queue = [req("a", [1], 0, out=10), req("b", [2], 1, out=500), req("c", [3], 2, out=10)]
    queue.append(req("d", [4], 3, out=500))
    assert rids(sched(None, P.LOF).order(queue)) == ["b", "d", "a", "c"]


def test_random_is_a_seeded_permutation() -> None:
    queue = [req(str(i), [i], t=i) for i in range(20)]
    first, second = sched(None, P.RANDOM, seed=7), sched(None, P.RANDOM, seed=7)
    orders = [rids(first.order(queue)) for _ in range(3)]
    assert orders == [rids(second.order(queue)) for _ in range(3)]
    assert all(sorted(o, key=int) == rids(queue) for o in orders)
    assert any(o != rids(queue) for o in orders) and orders[0] != orders[1]


# ----- LPM ------------------------------------------------------------------------------------
def lpm_tree() -> RadixCache:
    tree = sim()
    tree.insert(RadixKey(list(range(100, 110))))  # 10 tokens
    tree.insert(RadixKey(list(range(200, 204))))  # 4 tokens
    return tree


def lpm_queue() -> list[WaitingRequest]:
    return [
        req("miss", [1, 2, 3], t=0),
        req("short", [*range(200, 204), 9], t=1),
        req("long", [*range(100, 110), 9], t=2),
        req("mid", [*range(100, 106), 7], t=3),
        req("short2", [200, 201, 202, 203], t=4),
    ]


def test_lpm_orders_by_matched_prefix_ties_by_arrival() -> None:
    plan = sched(lpm_tree(), P.LPM).plan(lpm_queue())
    assert plan.policy is P.LPM
    assert rids(plan.requests) == ["long", "mid", "short", "short2", "miss"]
    assert plan.cached_tokens == {"miss": 0, "short": 4, "long": 10, "mid": 6, "short2": 4}


async def test_lpm_counts_the_host_hit_too() -> None:
    # A span evicted from the device but backed up on the host stays in the tiered tree; it
    # needs no computing, so LPM counts it (at the host weight: 52 x 0.8 = 41.6 > 12).
    long, host = list(range(100, 112)), list(range(1, 53))
    async with tiered_with(on_host=[host], on_device=[long]) as tree:
        queue = [req("long", [*long, 9], t=0), req("host", [*host, 9], t=1)]
        plan = sched(tree, P.LPM).plan(queue)
        assert rids(plan.requests) == ["host", "long"]
        assert plan.cached_tokens == {"host": 52, "long": 12}
        tiers = {rid: (m.device, m.host) for rid, m in plan.matches.items()}
        assert tiers == {"host": (0, 52), "long": (12, 0)}


def test_a_plain_trees_peek_counts_host_only_nodes_as_host() -> None:
    # A plain tree holding a node the way the tiered cache leaves an evicted one (host pages,
    # no device slots): the device part ends there, the rest of the match is the host part.
    tree = RadixCache(RadixCacheConfig(page_size=1))
    tree.insert(RadixKey(list(range(1, 21))), torch.arange(20))
    tree.insert(RadixKey(list(range(1, 51))), torch.arange(50))
    host_only = tree.match_prefix(RadixKey(list(range(1, 51)))).last_device_node
    host_only.host_value, host_only.value = host_only.value, None
    peek = tree.peek_tiers(RadixKey([*range(1, 41), 7]))
    assert (peek.device, peek.host, peek.total) == (20, 20, 40)
    assert peek.last_node is host_only and peek.last_device_node is host_only.parent
    assert peek.weighted(0.5) == 30.0
    # LPM at weight 0.5: 20 + 15 = 35 beats 25 on the device; at 0.1, 23 does not.
    tree.insert(RadixKey(list(range(100, 125))), torch.arange(50, 75))  # 25 on the device
    queue = [req("dev", [*range(100, 125), 9], t=0), req("host", [*range(1, 51), 9], t=1)]
    assert rids(sched(tree, P.LPM, host_hit_weight=0.5).order(queue)) == ["host", "dev"]
    assert rids(sched(tree, P.LPM, host_hit_weight=0.1).order(queue)) == ["dev", "host"]


def test_lpm_falls_back_to_fcfs_past_the_queue_length_without_matching() -> None:
    tree = lpm_tree()
    queue = lpm_queue()
    at_limit = sched(tree, P.LPM, lpm_fcfs_fallback_queue_len=len(queue)).plan(queue)
    assert at_limit.policy is P.LPM and rids(at_limit.requests)[0] == "long"
    hits = {n.id: n.hit_count for n in tree.all_nodes()}
    over = sched(tree, P.LPM, lpm_fcfs_fallback_queue_len=len(queue) - 1).plan(queue)
    assert over.policy is P.FCFS
    assert rids(over.requests) == rids(queue)
    assert over.cached_tokens == {} and not over.deferred
    assert {n.id: n.hit_count for n in tree.all_nodes()} == hits  # the tree was not walked


def test_cache_aware_policies_degrade_to_fcfs_without_a_tree() -> None:
    queue = lpm_queue()[::-1]
    for policy in (P.LPM, P.DFS_WEIGHT):
        plan = sched(None, policy).plan(queue)
        assert plan.policy is P.FCFS and rids(plan.requests) == rids(lpm_queue())


# ----- DFS_WEIGHT -----------------------------------------------------------------------------
def test_dfs_weight_emits_the_heaviest_subtree_first() -> None:
    # Tree:  root ─ [1 2 3 4] ─┬─ [5 6]          (1 request below)
    #                          └─ [7 8] ─ [9]    (3 requests below, one ending at [9])
    #        root ─ [20 21 22]                   (1 request, but it arrived first)
    tree = sim()
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9], [20, 21, 22]):
        tree.insert(RadixKey(tokens))
    queue = [
        req("q", [20, 21, 22, 0], t=0),
        req("b56", [1, 2, 3, 4, 5, 6, 0], t=1),
        req("b78", [1, 2, 3, 4, 7, 8, 0], t=2),
        req("b789", [1, 2, 3, 4, 7, 8, 9, 0], t=3),
        req("b78x", [1, 2, 3, 4, 7, 8, 5], t=4),
        req("b1234", [1, 2, 3, 4, 0], t=5),
        req("none", [50, 51], t=6),
    ]
    plan = sched(tree, P.DFS_WEIGHT, in_batch_sharing=False).plan(queue)
    assert plan.policy is P.DFS_WEIGHT
    # [1 2 3 4] weighs 5 > [20 21 22]'s 1; under it [7 8] (3) before [5 6] (1); a node's own
    # requests follow its subtrees; the request that matched nothing ends at the root, last.
    assert rids(plan.requests) == ["b789", "b78", "b78x", "b56", "b1234", "q", "none"]


def test_dfs_weight_equal_weights_go_by_earliest_request_and_namespaces_split() -> None:
    tree = sim()
    tree.insert(RadixKey([1, 2, 3]))
    tree.insert(RadixKey([1, 2, 3], extra_key="t"))
    tree.insert(RadixKey([4, 5, 6]))
    queue = [
        req("b", [4, 5, 6, 0], t=0),
        req("a", [1, 2, 3, 0], t=1),
        req("ta", [1, 2, 3, 1], t=2, ns="t"),
        req("a2", [1, 2, 3, 9], t=3),
        req("tb", [1, 2, 3, 2], t=4, ns="t"),
    ]
    order = rids(sched(tree, P.DFS_WEIGHT, in_batch_sharing=False).order(queue))
    # Namespace None weighs 3, "t" 2; inside None, [1 2 3] (2) before [4 5 6] (1).
    assert order == ["a", "a2", "b", "ta", "tb"]


# ----- in-batch prefix sharing ----------------------------------------------------------------
SHARED = list(range(1000, 1064))  # 64 tokens nobody has cached


def test_in_batch_defers_exactly_the_second_sharer_of_a_long_uncached_prefix() -> None:
    tree = sim()
    tree.insert(RadixKey(list(range(5000, 5040))))  # a 40-token cached prefix
    queue = [
        req("first", [*SHARED, 1], t=0),
        req("second", [*SHARED, 2], t=1),
        req("short", [*SHARED[:8], 3, 4, 5], t=2),  # shares only 8 tokens with "first"
        req("cached", [*range(5000, 5040), *SHARED], t=3),  # own cache above the threshold
        req("other", list(range(7000, 7070)), t=4),
    ]
    plan = sched(tree, P.LPM).plan(queue)
    assert plan.deferred == frozenset({"second"})
    assert plan.stats == QueueStats(5, 1, 0.0)
    assert rids(plan.requests) == ["cached", "first", "short", "other", "second"]


def test_in_batch_third_sharer_is_deferred_too_and_namespaces_do_not_share() -> None:
    queue = [
        req("first", [*SHARED, 1], t=0),
        req("second", [*SHARED, 2], t=1),
        req("third", [*SHARED, 3], t=2),
        req("tenant", [*SHARED, 4], t=3, ns="t"),
    ]
    for policy in (P.LPM, P.DFS_WEIGHT):
        plan = sched(sim(), policy).plan(queue)
        assert plan.deferred == frozenset({"second", "third"})
        assert rids(plan.requests)[-2:] == ["second", "third"]


def test_in_batch_thresholds_and_switch() -> None:
    queue = [req("first", [*SHARED, 1], t=0), req("second", [*SHARED, 2], t=1)]
    assert not sched(sim(), P.LPM, in_batch_match_threshold=65).plan(queue).deferred
    assert not sched(sim(), P.LPM, in_batch_sharing=False).plan(queue).deferred
    # Page-granular: with 48-token pages only one page (48 tokens) of the 64 can be shared.
    assert sched(sim(48), P.LPM, in_batch_match_threshold=48).plan(queue).deferred == {"second"}
    assert not sched(sim(48), P.LPM, in_batch_match_threshold=49).plan(queue).deferred
    # Once "first" is cached, "second" has a long cached prefix and is no longer a candidate.
    tree = sim()
    tree.insert(RadixKey([*SHARED, 1]))
    assert not sched(tree, P.LPM).plan(queue[1:]).deferred


# ----- bad input ------------------------------------------------------------------------------
def test_config_errors() -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(policy="lpm")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SchedulerConfig(lpm_fcfs_fallback_queue_len=-1)
    with pytest.raises(ConfigError):
        SchedulerConfig(in_batch_match_threshold=0)
    with pytest.raises(ConfigError):
        DelayerConfig(max_hit_rate=1.5)
    with pytest.raises(ConfigError):
        DelayerConfig(max_delay_s=float("nan"))
    with pytest.raises(ConfigError):
        DelayerConfig(ewma_alpha=0)


@pytest.mark.parametrize(
    "bad",
    [
        [req("a", [1]), req("a", [2])],  # duplicate rid
        [WaitingRequest("a", [1, 2], 4, 0.0)],  # type: ignore[arg-type]  # not a RadixKey
        [WaitingRequest("a", RadixKey([1]), -1, 0.0)],
        [WaitingRequest("a", RadixKey([1]), 4, float("inf"))],
        [WaitingRequest(None, RadixKey([1]), 4, 0.0)],
        [WaitingRequest(("x", [1]), RadixKey([1]), 4, 0.0)],  # unhashable rid
    ],
)
def test_bad_requests_raise_and_change_nothing(bad: list[WaitingRequest]) -> None:
    tree = lpm_tree()
    before = [(n.id, n.hit_count, n.length) for n in tree.all_nodes()]
    good = [req("x", [100, 101, 102], t=0), *bad]
    for policy in P:
        s, twin = sched(tree, policy, seed=3), sched(tree, policy, seed=3)
        with pytest.raises(InvalidArgumentError):
            s.order(good)
        assert [(n.id, n.hit_count, n.length) for n in tree.all_nodes()] == before
        if policy is P.RANDOM:  # the generator did not advance
            queue = lpm_queue()
            assert s.order(queue) == twin.order(queue)


def test_bad_token_raises_typed() -> None:
    with pytest.raises(InvalidTokenError):
        sched(sim(), P.LPM).order([req("a", [1, -5])])


# ----- the prefill delayer --------------------------------------------------------------------
def test_delayer_holds_while_conditions_hold_and_releases_at_max_delay() -> None:
    clock = FakeClock(100.0)
    delayer = PrefillDelayer(DelayerConfig(max_delay_s=0.5, min_reusable=2), clock)
    stats = QueueStats(n_waiting=6, n_reusable=3, oldest_arrival=100.0)
    assert delayer.release_at(stats) == 100.5
    for now in (100.0, 100.2, 100.499):
        clock.now = now
        assert delayer.should_delay(stats)
    clock.now = 100.5
    assert not delayer.should_delay(stats)
    assert delayer.delayed_rounds == 3
    # A younger queue is held again: the bound is per oldest waiting request.
    assert delayer.should_delay(QueueStats(4, 2, oldest_arrival=100.4))


def test_delayer_does_not_hold_without_sharing_or_with_a_good_hit_rate() -> None:
    clock = FakeClock(100.0)
    delayer = PrefillDelayer(
        DelayerConfig(max_delay_s=1.0, min_reusable=2, max_hit_rate=0.5), clock
    )
    assert not delayer.should_delay(QueueStats(0))
    assert not delayer.should_delay(QueueStats(5, 1, 100.0))  # too few reusable
    delayer.observe(hit_tokens=80, total_tokens=100)  # first batch: taken as is
    assert delayer.hit_rate == pytest.approx(0.8)
    assert not delayer.should_delay(QueueStats(5, 4, 100.0))
    for _ in range(3):  # the EWMA decays toward the new cold batches
        delayer.observe(0, 100)
    assert delayer.hit_rate == pytest.approx(0.8 * 0.75**3)
    assert delayer.should_delay(QueueStats(5, 4, 100.0))
    delayer.observe(0, 0)  # an empty batch says nothing
    assert delayer.hit_rate == pytest.approx(0.8 * 0.75**3)


def test_delayer_bad_input() -> None:
    delayer = PrefillDelayer(clock=FakeClock(100.0))
    with pytest.raises(InvalidArgumentError):
        delayer.observe(5, 4)
    with pytest.raises(InvalidArgumentError):
        delayer.observe(-1, 4)
    assert delayer.hit_rate == 0.0
    with pytest.raises(InvalidArgumentError):
        QueueStats(2, 3, 0.0)
    with pytest.raises(InvalidArgumentError):
        QueueStats(2, 0)
    with pytest.raises(InvalidArgumentError):
        delayer.should_delay((2, 1, 0.0))  # type: ignore[arg-type]


def test_plan_feeds_the_delayer() -> None:
    clock = FakeClock(100.0)
    queue = [req(f"r{i}", [*SHARED, i], t=100.0 + i / 100) for i in range(4)]
    plan = sched(sim(), P.LPM).plan(queue)
    assert plan.stats == QueueStats(4, 3, 100.0)
    delayer = PrefillDelayer(DelayerConfig(max_delay_s=0.05), clock)
    assert delayer.should_delay(plan.stats)
    clock.now = 100.05
    assert not delayer.should_delay(plan.stats)


@pytest.mark.parametrize("policy", P)
def test_a_request_with_nothing_to_reuse_is_ordered(policy: SchedulePolicy) -> None:
    """A one-token prompt's key (its whole pages, the last token excluded) is empty."""
    tree = lpm_tree()
    queue = [WaitingRequest("one", RadixKey([]), 4, 0.0), req("x", [100, 101, 102], t=1)]
    plan = sched(tree, policy, seed=3).plan(queue)
    assert sorted(r.rid for r in plan.requests) == ["one", "x"]
    assert plan.cached_tokens.get("one", 0) == 0
