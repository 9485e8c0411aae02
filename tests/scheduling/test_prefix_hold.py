"""PrefixHold: a waiting request waits while a request in flight computes its uncached prefix.

Each test plays admission rounds as the serving loop does: a fresh hold per round from the keys
of the requests still computing their prompts, ``claim`` for each request admitted in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hicache.errors import InvalidArgumentError
from hicache.keys import RadixKey
from hicache.radix import RadixCache, RadixCacheConfig
from hicache.scheduling.prefix_hold import PrefixHold
from hicache.scheduling.request import WaitingRequest
from hicache.scheduling.scheduler import (
    PrefixScheduler,
    SchedulePolicy,
    SchedulerConfig,
)

PAGE = 4
SHARED = list(range(1000, 1064))  # 64 tokens, 16 pages: twice the default match threshold


def tree() -> RadixCache:
    return RadixCache(RadixCacheConfig(page_size=PAGE, simulated=True))


def req(rid: str, tokens: Sequence[int], ns: str | None = None) -> WaitingRequest:
    return WaitingRequest(rid, RadixKey(list(tokens), extra_key=ns))


def scheduler(real: RadixCache, **kw: object) -> PrefixScheduler:
    return PrefixScheduler(real, SchedulerConfig(**kw))  # type: ignore[arg-type]


def held(sched: PrefixScheduler, computing: Sequence[RadixKey], waiter: WaitingRequest) -> bool:
    """Whether ``waiter`` waits in a round where ``computing`` are computing their prompts."""
    hold = sched.hold(computing)
    assert hold is not None
    return hold.holds(waiter)


def admitted(hold: PrefixHold, queue: Sequence[WaitingRequest]) -> list[str]:
    """One round: the rids admitted in order, each claimed as it goes (no room limit)."""
    out = []
    for r in queue:
        if not hold.holds(r):
            hold.claim(r.key)
            out.append(str(r.rid))
    return out


def test_held_while_a_running_request_computes_the_shared_prefix() -> None:
    real = tree()
    holder = req("holder", [*SHARED, 1, 2, 3])
    waiter = req("w", [*SHARED, 7, 8, 9])
    hold = scheduler(real).hold([holder.key])
    assert hold is not None
    assert hold.holds(waiter)
    assert hold.held == {"w"}


def test_released_once_the_holder_commits_the_shared_pages() -> None:
    real = tree()
    holder = req("holder", [*SHARED, 1, 2, 3])
    waiter = req("w", [*SHARED, 7, 8, 9])
    sched = scheduler(real)
    real.insert(RadixKey(SHARED[:32]))  # one chunk committed: 32 tokens still to come
    assert held(sched, [holder.key], waiter)
    real.insert(RadixKey(SHARED[:48]))  # 16 to come: below the threshold, not worth a round
    assert not held(sched, [holder.key], waiter)
    real.insert(RadixKey(SHARED))
    assert not held(sched, [holder.key], waiter)


def test_the_plans_cached_figure_is_used_and_only_peeked_when_missing() -> None:
    real = tree()
    real.insert(RadixKey(SHARED))
    holder = req("holder", [*SHARED, 1, 2, 3])
    waiter = req("w", [*SHARED, 7, 8, 9])
    hold = scheduler(real).hold([holder.key])
    assert hold is not None
    assert not hold.holds(waiter)  # peeked: the tree has all of it
    assert hold.holds(waiter, cached=0)  # as a stale plan would say: trusted


def test_released_when_the_holder_leaves_prefill_without_committing() -> None:
    # Whether it finished, failed or is now decoding, the loop no longer lists it as computing:
    # nothing of the last round's hold carries over.
    real = tree()
    holder = req("holder", [*SHARED, 1, 2, 3])
    waiter = req("w", [*SHARED, 7, 8, 9])
    sched = scheduler(real)
    assert held(sched, [holder.key], waiter)
    assert not held(sched, [], waiter)


def test_with_nothing_running_the_first_is_admitted_and_the_sharers_held() -> None:
    real = tree()
    queue = [req(f"r{i}", [*SHARED, i]) for i in range(4)] + [req("other", range(64))]
    sched = scheduler(real)
    plan = sched.plan(queue)
    hold = sched.hold([])
    assert hold is not None
    assert admitted(hold, plan.requests) == ["r0", "other"]
    assert hold.held == {"r1", "r2", "r3"}


def test_every_policy_holds() -> None:
    real = tree()
    queue = [req("a", [*SHARED, 1]), req("b", [*SHARED, 2])]
    for policy in SchedulePolicy:
        sched = scheduler(real, policy=policy, seed=0)
        hold = sched.hold([])
        assert hold is not None
        assert len(admitted(hold, sched.order(queue))) == 1, policy


def test_in_batch_sharing_off_or_no_tree_holds_nothing() -> None:
    assert scheduler(tree(), in_batch_sharing=False).hold([RadixKey(SHARED)]) is None
    assert PrefixScheduler(None).hold([RadixKey(SHARED)]) is None


@pytest.mark.parametrize(
    ("tokens", "ns"),
    [
        (list(range(2000, 2064)), None),  # another prefix
        ([*SHARED[:28], 9, 9, 9, 9], None),  # 28 tokens shared: below the threshold
        ([*SHARED, 7], "tenant-b"),  # the same tokens in another namespace
    ],
)
def test_not_held_without_a_long_enough_shared_prefix(tokens: list[int], ns: str | None) -> None:
    hold = scheduler(tree()).hold([RadixKey([*SHARED, 1, 2])])
    assert hold is not None
    assert not hold.holds(req("w", tokens, ns))
    assert not hold.held


def test_threshold_follows_the_config() -> None:
    real = tree()
    holder = RadixKey([*SHARED, 1])
    waiter = req("w", [*SHARED, 2])
    assert held(scheduler(real, in_batch_match_threshold=64), [holder], waiter)
    assert not held(scheduler(real, in_batch_match_threshold=68), [holder], waiter)


def test_a_prompt_with_nothing_reusable_is_never_held() -> None:
    hold = scheduler(tree()).hold([RadixKey(SHARED)])
    assert hold is not None
    assert not hold.holds(req("one-token", []))


def test_bad_input_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        PrefixHold(tree(), 0)
    hold = PrefixHold(tree(), 32)
    with pytest.raises(InvalidArgumentError):
        hold.claim(SHARED)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        hold.holds(object())  # type: ignore[arg-type]
