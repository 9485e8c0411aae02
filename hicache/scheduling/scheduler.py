"""Waiting-queue scheduling: which requests to prefill first, and when to hold prefill.

Cache-agnostic policies (FCFS, LOF, RANDOM) only sort the queue. Cache-aware ones peek every
waiting request's prefix on every tier of the tree (``tree.peek_tiers``: device and host) and
value it as ``device + host_hit_weight * host`` tokens (:mod:`hicache.scheduling.host_weight`):
LPM puts the most valuable cached prefix first; DFS_WEIGHT walks the tree and emits the requests
of the heaviest shared subtree first, grouped by where their device + host prefix ends, so
requests that reuse the same pages are admitted together while those pages are hot. The peeks
are the plan's ``matches``: the serving loop keeps each on its request for the round.

In-batch prefix sharing: two waiting requests that share a long prefix nobody has cached would
both compute it if admitted in the same batch. Requests with little cached prefix are therefore
run through a throwaway simulated tree of the queue (in arrival order); one that shares enough
with an earlier such request is *deferred*: ordered after everyone else for this round, and held
back (:mod:`hicache.scheduling.prefix_hold`) while a request in flight computes that prefix.

The prefill delayer holds prefill for a bounded time when many waiting requests share prefixes
and the recent hit rate is low: a burst of requests with a common prefix then gathers into one
round, where in-batch sharing computes the prefix once, instead of trickling into batches that
each recompute it. No request is held longer than ``max_delay_s`` after it arrived.
"""

from __future__ import annotations

import enum
import logging
import math
import random
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.radix import RadixCache, RadixCacheConfig, TreeNode
from hicache.radix.tier_peek import TierPeek
from hicache.scheduling.host_weight import DEFAULT_HOST_HIT_WEIGHT, check_host_hit_weight
from hicache.scheduling.prefix_hold import PrefixHold
from hicache.scheduling.request import SchedulableRequest

__all__ = [
    "DelayerConfig",
    "PrefillDelayer",
    "PrefixScheduler",
    "QueueStats",
    "SchedulePlan",
    "SchedulePolicy",
    "SchedulerConfig",
]

logger = logging.getLogger(__name__)

_NOTHING = TierPeek(0)  # the peek of an empty key: nothing can be cached for it


class SchedulePolicy(enum.Enum):
    FCFS = "fcfs"  # first come, first served (by arrival time)
    LOF = "lof"  # longest output first (by max_new_tokens)
    RANDOM = "random"  # a seeded shuffle
    LPM = "lpm"  # longest cached prefix first
    DFS_WEIGHT = "dfs_weight"  # depth-first over the tree, heaviest shared subtree first

    @property
    def cache_aware(self) -> bool:
        return self in (SchedulePolicy.LPM, SchedulePolicy.DFS_WEIGHT)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_real(name: str, value: object, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(f"{name} must be a number in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class DelayerConfig:
    """When :class:`PrefillDelayer` holds prefill.

    It holds while at least ``min_reusable`` waiting requests share a prefix with an earlier
    waiting one, the hit-rate EWMA (weight ``ewma_alpha`` on the newest batch) is below
    ``max_hit_rate``, and the oldest waiting request arrived less than ``max_delay_s`` ago.
    """

    max_delay_s: float = 0.05
    min_reusable: int = 2
    max_hit_rate: float = 0.5
    ewma_alpha: float = 0.25

    def __post_init__(self) -> None:
        _check_real("max_delay_s", self.max_delay_s, 0.0)
        _check_int("min_reusable", self.min_reusable, 1)
        _check_real("max_hit_rate", self.max_hit_rate, 0.0, 1.0)
        _check_real("ewma_alpha", self.ewma_alpha, 0.0, 1.0)
        if self.ewma_alpha == 0:
            raise ConfigError("ewma_alpha must be > 0, or the hit rate never moves")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How :class:`PrefixScheduler` orders the waiting queue.

    LPM falls back to FCFS (and matches nothing) when more than ``lpm_fcfs_fallback_queue_len``
    requests wait: matching a long queue every round costs more than the order gains. A cached
    prefix is worth its device tokens plus ``host_hit_weight`` (in [0, 1], default 0.8: see
    :mod:`hicache.scheduling.host_weight`) times its host tokens; 0 orders as if the host tier
    were empty. A request is a candidate for in-batch sharing when that worth is below
    ``in_batch_prefix_threshold`` tokens, and is deferred when it shares at least
    ``in_batch_match_threshold`` tokens with an earlier candidate; under any policy, any request
    is held while one in flight computes that many tokens of its prompt past its cached prefix
    (:meth:`PrefixScheduler.hold`). ``seed`` seeds RANDOM.
    """

    policy: SchedulePolicy = SchedulePolicy.LPM
    lpm_fcfs_fallback_queue_len: int = 128
    in_batch_sharing: bool = True
    in_batch_prefix_threshold: int = 32
    in_batch_match_threshold: int = 32
    seed: int | None = None
    delayer: DelayerConfig = field(default_factory=DelayerConfig)
    host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT

    def __post_init__(self) -> None:
        if not isinstance(self.policy, SchedulePolicy):
            raise ConfigError(f"policy must be a SchedulePolicy, got {self.policy!r}")
        _check_int("lpm_fcfs_fallback_queue_len", self.lpm_fcfs_fallback_queue_len, 0)
        _check_int("in_batch_prefix_threshold", self.in_batch_prefix_threshold, 0)
        # 0 would defer every candidate, the first included: nobody would compute the prefix.
        _check_int("in_batch_match_threshold", self.in_batch_match_threshold, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if not isinstance(self.delayer, DelayerConfig):
            raise ConfigError("delayer must be a DelayerConfig")
        check_host_hit_weight(self.host_hit_weight)


R = TypeVar("R", bound=SchedulableRequest)


@dataclass(frozen=True, slots=True)
class QueueStats:
    """What the delayer needs to know about the waiting queue.

    ``n_reusable`` counts waiting requests whose prefix an earlier waiting request will compute
    (the in-batch deferred ones).
    """

    n_waiting: int
    n_reusable: int = 0
    oldest_arrival: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("n_waiting", self.n_waiting), ("n_reusable", self.n_reusable)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")
        if self.n_reusable > self.n_waiting:
            raise InvalidArgumentError("n_reusable cannot exceed n_waiting")
        if self.n_waiting and self.oldest_arrival is None:
            raise InvalidArgumentError("a non-empty queue needs oldest_arrival")


@dataclass(frozen=True, slots=True)
class SchedulePlan(Generic[R]):
    """One round's order: ``requests`` (deferred ones last), the policy actually applied
    (LPM may fall back to FCFS), the deferred rids, the cached prefix per rid (device + host
    tokens, unweighted: what needs no computing) with the peek it came from (``matches``;
    cache-aware policies only) and the queue stats for the delayer.
    """

    requests: list[R]
    policy: SchedulePolicy
    deferred: frozenset[Hashable] = frozenset()
    cached_tokens: dict[Hashable, int] = field(default_factory=dict)
    matches: dict[Hashable, TierPeek] = field(default_factory=dict)
    stats: QueueStats = QueueStats(0)


def _validated(waiting: Sequence[R]) -> list[R]:
    """The queue in arrival order (stable); raises before anything is touched."""
    seen: set[Hashable] = set()
    for req in waiting:
        key = getattr(req, "key", None)
        if not isinstance(key, RadixKey):  # empty is fine: a prompt with no page to reuse
            raise InvalidArgumentError(f"request {req!r} needs a RadixKey")
        mnt = getattr(req, "max_new_tokens", None)
        if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 0:
            raise InvalidArgumentError(f"request {req!r}: max_new_tokens must be an int >= 0")
        at = getattr(req, "arrival_time", None)
        if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at):
            raise InvalidArgumentError(f"request {req!r}: arrival_time must be a finite number")
        rid = getattr(req, "rid", None)
        try:
            hash(rid)
        except TypeError:
            rid = None
        if rid is None:
            raise InvalidArgumentError(f"request {req!r}: rid must be hashable and not None")
        if rid in seen:
            raise InvalidArgumentError(f"duplicate rid {rid!r} in the waiting queue")
        seen.add(rid)
    return sorted(waiting, key=lambda r: r.arrival_time)


def _dfs_weight_order(last_nodes: Sequence[TreeNode], matched: Sequence[float]) -> list[int]:
    """Indices of requests (by their last matched node) depth-first, heaviest subtree first.

    A node weighs the number of requests ending in its subtree; siblings of equal weight go in
    order of their earliest request. A node's own requests follow its subtrees, longest match
    first (a match may end inside a node: the tree is only peeked, never split). Only nodes on
    some request's path are visited, iteratively (trees can be deep).
    """
    weight: dict[TreeNode, int] = {}
    first: dict[TreeNode, int] = {}
    kids: dict[TreeNode, list[TreeNode]] = {}
    ending: dict[TreeNode, list[int]] = {}
    roots: list[TreeNode] = []
    for i, last in enumerate(last_nodes):
        ending.setdefault(last, []).append(i)
        node: TreeNode | None = last
        while node is not None:
            if node in weight:
                weight[node] += 1
            else:
                weight[node], first[node] = 1, i
                parent = node.parent
                (roots if parent is None else kids.setdefault(parent, [])).append(node)
            node = node.parent

    def rank(n: TreeNode) -> tuple[int, int]:
        return (-weight[n], first[n])

    out: list[int] = []
    stack = [(root, False) for root in sorted(roots, key=rank, reverse=True)]
    while stack:
        node_, expanded = stack.pop()
        if expanded:
            out.extend(sorted(ending.get(node_, ()), key=lambda i: (-matched[i], i)))
            continue
        stack.append((node_, True))
        stack.extend((c, False) for c in sorted(kids.get(node_, ()), key=rank, reverse=True))
    return out


class PrefixScheduler:
    """Orders the waiting queue by a :class:`SchedulePolicy` over a prefix tree.

    ``tree`` may be None (no prefix cache): cache-aware policies then degrade to FCFS.
    Matching uses ``tree.peek_tiers``: ordering the queue counts no hit, refreshes no access
    time and splits no node, so it never changes what the tree evicts next. It is the only
    look at the tree a plan takes: once per waiting request per round.
    """

    def __init__(self, tree: RadixCache | None, config: SchedulerConfig | None = None) -> None:
        self.tree = tree
        self.config = config or SchedulerConfig()
        self._rng = random.Random(self.config.seed)

    def order(self, waiting: Sequence[R]) -> list[R]:
        """The waiting requests in the order to admit them this round."""
        return self.plan(waiting).requests

    def plan(self, waiting: Sequence[R]) -> SchedulePlan[R]:
        """This round's order with what was learnt computing it; see :class:`SchedulePlan`."""
        queue = _validated(waiting)
        oldest = queue[0].arrival_time if queue else None
        policy = self._effective_policy(len(queue))
        if policy.cache_aware:
            return self._plan_cache_aware(queue, policy)
        if policy is SchedulePolicy.LOF:
            requests = sorted(queue, key=lambda r: -r.max_new_tokens)
        elif policy is SchedulePolicy.RANDOM:
            requests = list(queue)
            self._rng.shuffle(requests)
        else:
            requests = queue
        return SchedulePlan(requests, policy, stats=QueueStats(len(queue), 0, oldest))

    def hold(self, computing: Iterable[RadixKey]) -> PrefixHold | None:
        """This round's :class:`PrefixHold`, given the keys of the requests computing their
        prompts; None (hold nothing) without a tree or with in-batch sharing off."""
        if self.tree is None or not self.config.in_batch_sharing:
            return None
        return PrefixHold(self.tree, self.config.in_batch_match_threshold, computing)

    def _effective_policy(self, queue_len: int) -> SchedulePolicy:
        policy = self.config.policy
        if policy.cache_aware and self.tree is None:
            return SchedulePolicy.FCFS
        if policy is SchedulePolicy.LPM and queue_len > self.config.lpm_fcfs_fallback_queue_len:
            logger.debug("LPM falls back to FCFS: %d waiting", queue_len)
            return SchedulePolicy.FCFS
        return policy

    def _plan_cache_aware(self, queue: list[R], policy: SchedulePolicy) -> SchedulePlan[R]:
        tree = self.tree
        assert tree is not None  # _effective_policy returns FCFS without a tree
        # A one-token prompt has no reusable page (its key is empty): nothing is cached for it.
        peeks = [tree.peek_tiers(r.key) if len(r.key) else _NOTHING for r in queue]
        weight = self.config.host_hit_weight
        worth = [p.weighted(weight) for p in peeks]
        deferred = self._in_batch_deferred(queue, worth) if self.config.in_batch_sharing else set()
        if policy is SchedulePolicy.LPM:
            idx = sorted(range(len(queue)), key=lambda i: -worth[i])  # stable: ties by arrival
        else:
            unmatched = TreeNode(0, b"", 0, None, 0.0)  # one group for requests with no match
            # A host part worth nothing does not group requests either.
            ends = [p.last_node if weight else p.last_device_node for p in peeks]
            idx = _dfs_weight_order([node or unmatched for node in ends], worth)
        ordered = [i for i in idx if i not in deferred] + [i for i in idx if i in deferred]
        return SchedulePlan(
            requests=[queue[i] for i in ordered],
            policy=policy,
            deferred=frozenset(queue[i].rid for i in deferred),
            cached_tokens={r.rid: p.total for r, p in zip(queue, peeks)},
            matches={r.rid: p for r, p in zip(queue, peeks)},
            stats=QueueStats(len(queue), len(deferred), queue[0].arrival_time if queue else None),
        )

    def _in_batch_deferred(self, queue: list[R], worth: list[float]) -> set[int]:
        """Indices of candidates (their cached prefix ``worth`` little) that share a long prefix
        with an earlier candidate."""
        assert self.tree is not None
        cfg = self.config
        # Same page size as the real tree: only whole pages can be reused.
        sim = RadixCache(RadixCacheConfig(page_size=self.tree.page_size, simulated=True))
        deferred: set[int] = set()
        for i, req in enumerate(queue):
            if worth[i] >= cfg.in_batch_prefix_threshold or not len(req.key):
                continue  # enough of it is cached already (or nothing can be), it gains little
            if sim.match_prefix(req.key).prefix_len >= cfg.in_batch_match_threshold:
                deferred.add(i)
            else:
                sim.insert(req.key)
        return deferred


class PrefillDelayer:
    """Decides each round whether to hold prefill; see the module docstring.

    Feed it the hit rate of every admitted prefill batch with :meth:`observe`; ask
    :meth:`should_delay` before admitting. ``clock`` must be the clock of ``arrival_time``.
    """

    def __init__(
        self, config: DelayerConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or DelayerConfig()
        self._clock = clock
        self._hit_rate = 0.0  # a cold cache: nothing has hit yet
        self._observed = False
        self.delayed_rounds = 0

    @property
    def hit_rate(self) -> float:
        """The EWMA of cached / prompt tokens over admitted batches."""
        return self._hit_rate

    def observe(self, hit_tokens: int, total_tokens: int) -> None:
        """Record one admitted batch: ``hit_tokens`` of its ``total_tokens`` were cached."""
        for name, value in (("hit_tokens", hit_tokens), ("total_tokens", total_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")
        if hit_tokens > total_tokens:
            raise InvalidArgumentError(f"{hit_tokens} hit tokens of only {total_tokens}")
        if total_tokens == 0:
            return
        rate = hit_tokens / total_tokens
        if not self._observed:
            self._hit_rate, self._observed = rate, True  # the first batch, not blended with 0
        else:
            alpha = self.config.ewma_alpha
            self._hit_rate = alpha * rate + (1.0 - alpha) * self._hit_rate

    def should_delay(self, stats: QueueStats) -> bool:
        """True to hold prefill this round."""
        if not isinstance(stats, QueueStats):
            raise InvalidArgumentError(f"expected QueueStats, got {type(stats).__name__}")
        if stats.n_waiting == 0 or stats.oldest_arrival is None:
            return False
        cfg = self.config
        hold = (
            self._clock() < stats.oldest_arrival + cfg.max_delay_s  # the same sum as release_at
            and stats.n_reusable >= cfg.min_reusable
            and self._hit_rate < cfg.max_hit_rate
        )
        if hold:
            self.delayed_rounds += 1
        return hold

    def release_at(self, stats: QueueStats) -> float | None:
        """The latest clock time a hold can last for this queue (to sleep until, not poll)."""
        if stats.oldest_arrival is None:
            return None
        return stats.oldest_arrival + self.config.max_delay_s
