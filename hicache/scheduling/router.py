"""Cache-aware routing of requests across N workers (data-parallel replicas, servers).

The router keeps, for each worker, an approximate simulated prefix tree of what that worker
has cached: the keys the router sent it (and, on :meth:`CacheAwareRouter.complete`, the
finished sequences), pruned least-recently-used first to ``max_tree_tokens``. With
``device_tree_tokens`` set it keeps a second tree of the same keys pruned to that size: what
the worker's device holds, its least recently used pages having moved to host as a tiered
worker moves them. A worker's match is worth its device tokens plus ``host_hit_weight`` times
the rest of its match (on host: loaded, not recomputed; :mod:`hicache.scheduling.host_weight`).
A request goes to the worker whose match is worth most, so requests that share a prefix land
where that prefix's KV already is, on device or host, unless that worker is overloaded.

Load is in whatever unit the caller uses consistently; by default tokens: :meth:`route` adds a
request's ``cost`` (its key length unless given) to the chosen worker, :meth:`complete`
subtracts it, and :meth:`report_load` overwrites a worker's load with what it measured.
Balance rule (an absolute margin, in load units): the longest-match worker is taken unless its
load exceeds the least-loaded worker's by more than ``balance_margin``; then the request goes to
a least-loaded worker. An absolute margin and not a ratio: a ratio is unstable near zero load
(1 token against 0 is "infinitely" imbalanced) and says nothing about queueing delay, which
grows with the absolute backlog.

Ties in match worth go to the lower load, then the smaller tree (spreading new prefixes over
workers with room), then the lower index. Namespaces (``RadixKey.extra_key``) never match
across: each is its own subtree.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache.errors import ConfigError, InvalidArgumentError, InvalidTokenError
from hicache.keys import RadixKey
from hicache.radix import EvictionPolicy, RadixCache, RadixCacheConfig
from hicache.scheduling.host_weight import DEFAULT_HOST_HIT_WEIGHT, check_host_hit_weight

__all__ = ["CacheAwareRouter", "RouterConfig", "RouterStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """``balance_margin``: how much more load (absolute, in load units, default tokens) the
    longest-match worker may carry than the least-loaded one before requests are diverted
    (``math.inf``: always follow the cache; 0: divert on any imbalance).
    ``max_tree_tokens``: the size bound of each worker's approximate tree (what its device and
    host hold). ``device_tree_tokens``: how much of that its device holds (None: all of it).
    ``host_hit_weight``: what a token on host is worth against one on the device, in [0, 1]
    (see :mod:`hicache.scheduling.host_weight`).
    ``page_size``: the workers' page size (only whole pages are cached, so only they match).
    """

    balance_margin: float = 8192.0
    max_tree_tokens: int = 1 << 20
    page_size: int = 1
    device_tree_tokens: int | None = None
    host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT

    def __post_init__(self) -> None:
        margin = self.balance_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
            raise ConfigError(f"balance_margin must be a number >= 0, got {margin!r}")
        for name, value in (
            ("page_size", self.page_size),
            ("max_tree_tokens", self.max_tree_tokens),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.max_tree_tokens < self.page_size:
            raise ConfigError("max_tree_tokens must hold at least one page")
        device = self.device_tree_tokens
        if device is not None and (
            not isinstance(device, int) or isinstance(device, bool) or device < 0
        ):
            raise ConfigError(f"device_tree_tokens must be an int >= 0 or None, got {device!r}")
        check_host_hit_weight(self.host_hit_weight)


@dataclass(slots=True)
class RouterStats:
    """Counters since the router was built."""

    routed: int = 0
    cache_hits: int = 0  # sent to a worker whose tree matched a non-empty prefix
    diverted: int = 0  # the longest-match worker was over the margin
    pruned_tokens: int = 0  # dropped from the approximate trees to keep them bounded


def _check_amount(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def _check_key(key: object) -> RadixKey:
    if not isinstance(key, RadixKey):
        raise InvalidArgumentError(f"expected a RadixKey, got {type(key).__name__}")
    if len(key) == 0:
        raise InvalidTokenError("an empty key cannot be routed")
    key.validate()  # a bad token raises here, before any tree is touched
    return key


class CacheAwareRouter:
    """Routes each request to the worker most likely to hold its prefix; see the module doc."""

    def __init__(
        self,
        n_workers: int,
        config: RouterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers <= 0:
            raise ConfigError(f"n_workers must be a positive int, got {n_workers!r}")
        self.config = config or RouterConfig()
        self._clock = clock
        tree_config = RadixCacheConfig(
            page_size=self.config.page_size, policy=EvictionPolicy.LRU, simulated=True
        )
        self._trees = [RadixCache(tree_config, clock=clock) for _ in range(n_workers)]
        device = self.config.device_tree_tokens
        # What each device holds: the same keys, pruned to the device's size (None: the whole tree).
        self._device_trees = (
            None
            if device is None or device >= self.config.max_tree_tokens
            else [RadixCache(tree_config, clock=clock) for _ in range(n_workers)]
        )
        self._loads = [0.0] * n_workers
        self._retired: set[int] = set()  # workers that get no more requests
        self.stats = RouterStats()

    @property
    def n_workers(self) -> int:
        return len(self._trees)

    @property
    def loads(self) -> tuple[float, ...]:
        return tuple(self._loads)

    def tree_size(self, worker: int) -> int:
        """Tokens in ``worker``'s approximate tree."""
        return self._trees[self._check_worker(worker)].total_size

    def worker_tree(self, worker: int) -> RadixCache:
        """``worker``'s approximate tree, for inspection (tests, tools); do not modify it."""
        return self._trees[self._check_worker(worker)]

    def route(self, key: RadixKey, cost: float | None = None) -> int:
        """Pick the worker for a request with ``key``; adds ``cost`` (default: the key's
        length) to its load and remembers ``key`` in its tree.
        """
        key = _check_key(key)
        amount = float(len(key)) if cost is None else _check_amount("cost", cost)
        matches = [tree.peek_prefix(key)[0] for tree in self._trees]
        worker = self._choose([self._worth(w, key, m) for w, m in enumerate(matches)])
        self._loads[worker] += amount
        self.stats.routed += 1
        if matches[worker] > 0:
            self.stats.cache_hits += 1
        self._remember(worker, key)
        return worker

    def report_load(self, worker: int, load: float) -> None:
        """Overwrite ``worker``'s load with a measured value (queued tokens, say)."""
        w = self._check_worker(worker)
        self._loads[w] = _check_amount("load", load)

    def complete(self, worker: int, cost: float, key: RadixKey | None = None) -> None:
        """A request routed to ``worker`` finished: subtract its ``cost`` (the load never goes
        below zero: a :meth:`report_load` may have counted it already) and, when given, remember
        ``key`` (the finished sequence, prompt and output, which the worker now caches).
        """
        w = self._check_worker(worker)
        amount = _check_amount("cost", cost)
        if key is not None:
            key = _check_key(key)
        self._loads[w] = max(0.0, self._loads[w] - amount)
        if key is not None:
            self._remember(w, key)

    def retire(self, worker: int) -> None:
        """Send ``worker`` nothing more (it died or stopped answering) until :meth:`readmit`;
        :meth:`route` raises InvalidArgumentError while every worker is retired."""
        self._retired.add(self._check_worker(worker))
        self._forget(worker)

    def readmit(self, worker: int) -> None:
        """Route to a retired ``worker`` again (it answers again), with no cached prefix known
        and no load."""
        w = self._check_worker(worker)
        self._retired.discard(w)
        self._loads[w] = 0.0

    @property
    def alive(self) -> list[int]:
        """The workers requests may go to."""
        return [w for w in range(len(self._trees)) if w not in self._retired]

    def reset_worker(self, worker: int) -> None:
        """Forget what ``worker`` cached (it restarted or flushed its cache); its load is kept."""
        self._forget(self._check_worker(worker))

    # ----- internals ------------------------------------------------------------------------
    def _check_worker(self, worker: object) -> int:
        if not isinstance(worker, int) or isinstance(worker, bool):
            raise InvalidArgumentError(f"a worker index is an int, got {worker!r}")
        if not 0 <= worker < len(self._trees):
            raise InvalidArgumentError(f"worker {worker} out of range [0, {len(self._trees)})")
        return worker

    def _worth(self, worker: int, key: RadixKey, matched: int) -> float:
        """What ``worker``'s ``matched`` tokens of ``key`` are worth: those on its device in
        full, the rest (on host) at ``host_hit_weight``."""
        if self._device_trees is None:
            return float(matched)
        device = min(matched, self._device_trees[worker].peek_prefix(key)[0])
        return device + self.config.host_hit_weight * (matched - device)

    def _forget(self, worker: int) -> None:
        self._trees[worker].reset()
        if self._device_trees is not None:
            self._device_trees[worker].reset()

    def _choose(self, matches: Sequence[float]) -> int:
        loads, trees = self._loads, self._trees
        workers = self.alive
        if not workers:
            raise InvalidArgumentError("every worker is retired: there is nowhere to route")
        best = min(workers, key=lambda w: (-matches[w], loads[w], trees[w].total_size, w))
        least = min(loads[w] for w in workers)
        if loads[best] - least <= self.config.balance_margin:
            return best
        self.stats.diverted += 1
        idle = [w for w in workers if loads[w] == least]
        chosen = min(idle, key=lambda w: (-matches[w], trees[w].total_size, w))
        logger.debug("diverted from worker %d (load %.0f) to %d", best, loads[best], chosen)
        return chosen

    def _remember(self, worker: int, key: RadixKey) -> None:
        tree = self._trees[worker]
        tree.insert(key)
        excess = tree.total_size - self.config.max_tree_tokens
        if excess > 0:
            self.stats.pruned_tokens += tree.evict(excess)
        if self._device_trees is not None:  # the device's least recently used pages go to host
            device = self._device_trees[worker]
            device.insert(key)
            over = device.total_size - (self.config.device_tree_tokens or 0)
            if over > 0:
                device.evict(over)
