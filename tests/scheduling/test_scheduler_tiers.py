"""Cache-aware scheduling over a real tiered tree: host hits count, at the configured weight.

Every tree here is a :class:`~hicache.tiering.cache.HiRadixCache` with some prefixes evicted to
host (and backed up there) and others on the device; the scheduler peeks them, never matches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from tiered_tree_kit import tiered_with

from hicache.errors import ConfigError
from hicache.keys import RadixKey
from hicache.scheduling.prefix_hold import PrefixHold
from hicache.scheduling.request import WaitingRequest
from hicache.scheduling.scheduler import PrefixScheduler, SchedulePolicy, SchedulerConfig
from hicache.tiering.cache import HiRadixCache

P = SchedulePolicy
HOST = list(range(1000, 1032))  # 32 tokens, evicted to host
DEVICE = list(range(2000, 2008))  # 8 tokens, on the device


def req(rid: str, tokens: Sequence[int], t: float) -> WaitingRequest:
    return WaitingRequest(rid, RadixKey(list(tokens)), 16, t)


def rids(requests: Sequence[WaitingRequest]) -> list[str]:
    return [str(r.rid) for r in requests]


def sched(tree: HiRadixCache, policy: SchedulePolicy, **kw: object) -> PrefixScheduler:
    return PrefixScheduler(tree, SchedulerConfig(policy=policy, **kw))  # type: ignore[arg-type]


def state(tree: HiRadixCache) -> list[tuple[object, ...]]:
    """What ordering must not change: nodes, spans, hits, ages, tiers."""
    return sorted(
        (n.id, n.length, n.hit_count, n.last_access_time, n.access_tick, n.value is None)
        for n in tree.all_nodes()
    )


async def test_lpm_puts_the_longer_host_hit_first_at_the_host_weight() -> None:
    async with tiered_with(on_host=[HOST], on_device=[DEVICE]) as tree:
        queue = [req("dev", [*DEVICE, 1, 2], 0), req("host", [*HOST, 3], 1), req("miss", [5], 2)]
        before = state(tree)
        plan = sched(tree, P.LPM).plan(queue)  # 32 host tokens x 0.8 = 25.6 > 8 device ones
        assert state(tree) == before  # peeked: no split, hit or access time
        assert rids(plan.requests) == ["host", "dev", "miss"]
        assert plan.cached_tokens == {"dev": 8, "host": 32, "miss": 0}
        peeks = {rid: (m.device, m.host) for rid, m in plan.matches.items()}
        assert peeks == {"dev": (8, 0), "host": (0, 32), "miss": (0, 0)}
        # 32 x 0.2 = 6.4 < 8; at 0 the host tier counts for nothing.
        for weight in (0.0, 0.2):
            plan = sched(tree, P.LPM, host_hit_weight=weight).plan(queue)
            assert rids(plan.requests) == ["dev", "host", "miss"], weight
        # 32 x 0.25 = 8: a tie, in arrival order.
        tie = sched(tree, P.LPM, host_hit_weight=0.25).plan(queue[::-1])
        assert rids(tie.requests) == ["dev", "host", "miss"]


async def test_dfs_weight_groups_requests_by_where_their_host_hit_ends() -> None:
    queue = [
        req("m1", [5, 6, 7, 8, 9], 0),
        req("d1", [*DEVICE, 1], 1),
        req("h1", [*HOST, 1], 2),
        req("m2", [50, 60, 70, 80, 90], 3),
        req("h2", [*HOST[:16], 9, 9, 9, 9, 9], 4),  # ends inside the host node
        req("h3", [*HOST, 2], 5),
        req("d2", [*DEVICE, 2], 6),
    ]
    async with tiered_with(on_host=[HOST], on_device=[DEVICE]) as tree:
        plan = sched(tree, P.DFS_WEIGHT, in_batch_sharing=False).plan(queue)
        # The host node's three requests, longest first, then the device node's two (the
        # tree's root holds both groups), then the misses.
        assert rids(plan.requests) == ["h1", "h3", "h2", "d1", "d2", "m1", "m2"]
        # At weight 0 a host hit is a miss: five requests with nothing, in arrival order, go
        # before the device node's two.
        zero = sched(tree, P.DFS_WEIGHT, in_batch_sharing=False, host_hit_weight=0.0)
        assert rids(zero.plan(queue).requests) == ["m1", "h1", "m2", "h2", "h3", "d1", "d2"]


async def test_in_batch_sharing_counts_the_host_hit_as_cached() -> None:
    host = list(range(3000, 3040))  # 40 tokens on host: worth 32 at 0.8, the threshold
    queue = [req("x1", [*host, 1], 0), req("x2", [*host, 2], 1)]
    async with tiered_with(on_host=[host], on_device=[]) as tree:
        plan = sched(tree, P.LPM).plan(queue)
        assert plan.deferred == frozenset() and plan.stats.n_reusable == 0
        # Counted as nothing, the shared 40 tokens look uncached: the second would compute them
        # again alongside the first, so it is deferred.
        zero = sched(tree, P.LPM, host_hit_weight=0.0).plan(queue)
        assert zero.deferred == frozenset({"x2"}) and rids(zero.requests) == ["x1", "x2"]


async def test_a_prefix_hold_subtracts_what_host_holds() -> None:
    # A running request computes the host prefix and 40 tokens past it; a waiting request
    # shares all of it. Only the 8 tokens past what the host holds are on their way: no hold.
    computing = RadixKey([*HOST, *range(5000, 5040)])
    async with tiered_with(on_host=[HOST], on_device=[]) as tree:
        hold = PrefixHold(tree, 32, [computing])
        assert not hold.holds(req("on-host", [*HOST, *range(5000, 5009)], 0))
        assert hold.holds(req("miss", [*range(5000, 5040), 1], 0)) is False  # shares nothing
        other = PrefixHold(tree, 32, [RadixKey(list(range(7000, 7080)))])
        assert other.holds(req("uncached", [*range(7000, 7040), 1], 0))
        assert other.held == {"uncached"}


@pytest.mark.parametrize("bad", [-0.1, 1.01, math.nan, math.inf, "0.5", True, None])
def test_a_host_hit_weight_outside_0_1_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="host_hit_weight"):
        SchedulerConfig(host_hit_weight=bad)  # type: ignore[arg-type]
