"""Backends that wrap another backend to add one cross-cutting behaviour.

A wrapper is a :class:`StorageBackend` whose storage is another backend (``inner``). It forwards
every call to the inner backend's public methods, so the inner backend keeps its own counters
and checks; the wrapper's counters describe what its caller saw. Wrappers are built in code,
``LatencyBackend(MemoryBackend(), LatencyConfig(latency_s=0.002))``, not from URLs.

- :class:`FaultInjectionBackend` fails, stalls or corrupts calls, deterministically by seed, so
  tests can drive the cache controller against unreliable storage.
- :class:`LatencyBackend` adds a per-call latency and a bandwidth-limited link shared by
  concurrent calls, with an injectable clock and sleep so tests run on fake time.
"""

from __future__ import annotations

import asyncio
import enum
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hicache.backends.base import (
    MISS,
    ObjectInfo,
    StorageBackend,
    join_segments,
    segments_nbytes,
)
from hicache.errors import BackendUnavailableError, ConfigError, InvalidArgumentError

__all__ = [
    "FaultConfig",
    "FaultInjectionBackend",
    "FaultMode",
    "LatencyBackend",
    "LatencyConfig",
    "Operation",
    "SleepFn",
    "WrapperBackend",
]


SleepFn = Callable[[float], Awaitable[Any]]
T = TypeVar("T")


class WrapperBackend(StorageBackend):
    """A transparent pass-through to ``inner``; subclasses override the calls they change.

    Capabilities are the inner backend's. ``stats()`` reports the inner backend's stats under
    ``inner.`` plus the wrapper's own (:meth:`_wrapper_stats`). ``close()`` closes ``inner``.
    """

    name = "wrapper"

    def __init__(self, inner: StorageBackend) -> None:
        if not isinstance(inner, StorageBackend):
            raise InvalidArgumentError(f"a wrapper needs a StorageBackend, not {type(inner)}")
        super().__init__()
        self.inner = inner
        self.capabilities = inner.capabilities

    @classmethod
    async def open(cls, config: Any) -> Any:
        raise InvalidArgumentError(
            f"{cls.__name__} wraps another backend: build it in code, e.g. "
            f"{cls.__name__}(inner_backend, config)"
        )

    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self.inner.exists(keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        return await self.inner.get_into(keys, buffers)

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        return await self.inner.put(keys, values)

    async def _delete(self, keys: list[str]) -> list[bool]:
        return await self.inner.delete(keys)

    def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        return self.inner.scan(prefix)

    async def _stats(self) -> dict[str, int | float]:
        merged: dict[str, int | float] = {
            f"inner.{k}": v for k, v in (await self.inner.stats()).items()
        }
        merged.update(self._wrapper_stats())
        return merged

    def _wrapper_stats(self) -> dict[str, int | float]:
        """The wrapper's own counters; none for a plain pass-through."""
        return {}

    async def _close(self) -> None:
        await self.inner.close()


# ----- fault injection ------------------------------------------------------------------------
class Operation(enum.Enum):
    """The calls a fault configuration can affect."""

    EXISTS = "exists"
    GET = "get"
    PUT = "put"
    DELETE = "delete"


class FaultMode(enum.Enum):
    """How an injected failure shows: as failed per-key results, or as a raised error."""

    RETURN = "return"  # put -> False, get_into -> MISS, exists -> False, delete -> False
    RAISE = "raise"  # the whole call raises BackendUnavailableError


ALL_OPERATIONS: frozenset[Operation] = frozenset(Operation)


def _check_rate(name: str, value: float) -> None:
    # Written so that NaN fails too.
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ConfigError(f"FaultConfig.{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Which faults to inject and how often; all rates are probabilities in [0, 1].

    ``fail_rate`` is decided per key (per call in RAISE mode, where one failure fails the
    call); ``stall_rate`` per call; ``corrupt_rate`` per key of a get or put.
    """

    fail_rate: float = 0.0
    fail_mode: FaultMode = FaultMode.RETURN
    stall_rate: float = 0.0
    stall_seconds: float = 30.0
    corrupt_rate: float = 0.0
    seed: int = 0
    operations: frozenset[Operation] = ALL_OPERATIONS

    def __post_init__(self) -> None:
        for name in ("fail_rate", "stall_rate", "corrupt_rate"):
            _check_rate(name, getattr(self, name))
        if not (math.isfinite(self.stall_seconds) and self.stall_seconds >= 0):
            raise ConfigError(f"FaultConfig.stall_seconds must be >= 0, got {self.stall_seconds}")
        if not isinstance(self.fail_mode, FaultMode):
            raise ConfigError(f"FaultConfig.fail_mode must be a FaultMode, got {self.fail_mode!r}")
        if not isinstance(self.operations, frozenset) or not all(
            isinstance(op, Operation) for op in self.operations
        ):
            raise ConfigError("FaultConfig.operations must be a frozenset of Operation")


@dataclass(frozen=True, slots=True)
class _FaultPlan:
    """The faults decided for one call, all drawn before its first await."""

    stall: bool
    raise_error: bool
    failed: list[bool]
    corrupt_at: list[float | None]  # per key: where to flip a byte, as a fraction of its size


def _draw(rng: random.Random, rate: float) -> bool:
    # A zero rate consumes nothing, so enabling one fault kind never shifts another's pattern.
    return rate > 0.0 and rng.random() < rate


def _scatter(failed: Sequence[bool], kept: Sequence[T], fill: T) -> list[T]:
    """Per-key results: ``fill`` where the key failed, else the next of ``kept``."""
    it = iter(kept)
    return [fill if f else next(it) for f in failed]


def _flip_byte(segments: Sequence[memoryview], position: int) -> None:
    for seg in segments:
        if position < seg.nbytes:
            seg[position] ^= 0xFF  # every bit changes, so the byte surely differs
            return
        position -= seg.nbytes


class FaultInjectionBackend(WrapperBackend):
    """Fails, stalls or corrupts calls to ``inner`` at configured rates, reproducibly.

    The same seed and the same sequence of calls give the same faults. Each fault kind draws
    from its own stream (derived from the seed), so e.g. the failure pattern does not change
    when a corrupt rate is added. Stalls await ``sleep(stall_seconds)`` in the caller's task
    and so end cleanly when the caller is cancelled or times out.
    """

    name = "faults"
    config_type = FaultConfig

    def __init__(
        self,
        inner: StorageBackend,
        config: FaultConfig | None = None,
        *,
        sleep: SleepFn = asyncio.sleep,
    ) -> None:
        super().__init__(inner)
        self._sleep = sleep
        self._faults = {"injected_failures": 0, "injected_stalls": 0, "injected_corruptions": 0}
        self.set_faults(config or FaultConfig())

    def set_faults(self, config: FaultConfig) -> None:
        """Switch to ``config`` from the next call on; its seed restarts the random streams."""
        if not isinstance(config, FaultConfig):
            raise InvalidArgumentError(f"expected a FaultConfig, got {type(config).__name__}")
        self.config = config
        self._fail_rng = random.Random(f"{config.seed}:fail")
        self._stall_rng = random.Random(f"{config.seed}:stall")
        self._corrupt_rng = random.Random(f"{config.seed}:corrupt")

    def _plan(self, op: Operation, n: int) -> _FaultPlan | None:
        cfg = self.config
        if op not in cfg.operations:
            return None
        stall = _draw(self._stall_rng, cfg.stall_rate)
        if cfg.fail_mode is FaultMode.RAISE:
            raise_error, failed = _draw(self._fail_rng, cfg.fail_rate), [False] * n
        else:
            raise_error, failed = False, [_draw(self._fail_rng, cfg.fail_rate) for _ in range(n)]
        corrupt_at: list[float | None] = [None] * n
        if op in (Operation.GET, Operation.PUT):
            rng = self._corrupt_rng
            corrupt_at = [rng.random() if _draw(rng, cfg.corrupt_rate) else None for _ in range(n)]
        return _FaultPlan(stall, raise_error, failed, corrupt_at)

    async def _begin(self, op: Operation, plan: _FaultPlan) -> None:
        """Stall and raise as planned; returns when the call should go ahead."""
        if plan.stall:
            self._faults["injected_stalls"] += 1
            await self._sleep(self.config.stall_seconds)
        if plan.raise_error:
            self._faults["injected_failures"] += 1
            raise BackendUnavailableError(f"injected failure in {op.value}")
        self._faults["injected_failures"] += sum(plan.failed)

    async def _exists(self, keys: list[str]) -> list[bool]:
        plan = self._plan(Operation.EXISTS, len(keys))
        if plan is None:
            return await self.inner.exists(keys)
        await self._begin(Operation.EXISTS, plan)
        kept = [k for k, f in zip(keys, plan.failed, strict=True) if not f]
        found = await self.inner.exists(kept) if kept else []
        return _scatter(plan.failed, found, False)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        plan = self._plan(Operation.GET, len(keys))
        if plan is None:
            return await self.inner.get_into(keys, buffers)
        await self._begin(Operation.GET, plan)
        ok = [i for i, f in enumerate(plan.failed) if not f]
        sizes = await self.inner.get_into([keys[i] for i in ok], [buffers[i] for i in ok])
        for i, n in zip(ok, sizes, strict=True):
            where = plan.corrupt_at[i]
            if where is not None and 0 < n <= segments_nbytes(buffers[i]):
                _flip_byte(buffers[i], int(where * n))
                self._faults["injected_corruptions"] += 1
        return _scatter(plan.failed, sizes, MISS)

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        plan = self._plan(Operation.PUT, len(keys))
        if plan is None:
            return await self.inner.put(keys, values)
        await self._begin(Operation.PUT, plan)
        kept_keys: list[str] = []
        kept_values: list[list[memoryview]] = []
        for key, segs, failed, where in zip(
            keys, values, plan.failed, plan.corrupt_at, strict=True
        ):
            if failed:
                continue
            size = segments_nbytes(segs)
            if where is not None and size > 0:
                copy = join_segments(segs)  # the caller's buffer stays intact
                copy[int(where * size)] ^= 0xFF
                segs = [memoryview(copy)]
                self._faults["injected_corruptions"] += 1
            kept_keys.append(key)
            kept_values.append(segs)
        stored = await self.inner.put(kept_keys, kept_values) if kept_keys else []
        return _scatter(plan.failed, stored, False)

    async def _delete(self, keys: list[str]) -> list[bool]:
        plan = self._plan(Operation.DELETE, len(keys))
        if plan is None:
            return await self.inner.delete(keys)
        await self._begin(Operation.DELETE, plan)
        kept = [k for k, f in zip(keys, plan.failed, strict=True) if not f]
        removed = await self.inner.delete(kept) if kept else []
        return _scatter(plan.failed, removed, False)

    def _wrapper_stats(self) -> dict[str, int | float]:
        return dict(self._faults)


# ----- latency and bandwidth --------------------------------------------------------------
def _check_bandwidth(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ConfigError(f"LatencyConfig.{name} must be a positive number or None, got {value}")


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    """A per-call latency plus optional read and write bandwidths in bytes per second.

    A call moving ``n`` bytes over an idle link takes ``latency_s + n / bandwidth``. Reads and
    writes each have one link (full duplex, like a NIC); concurrent transfers in the same
    direction queue behind each other. ``None`` means unlimited bandwidth.
    """

    latency_s: float = 0.0
    read_bandwidth_bps: float | None = None
    write_bandwidth_bps: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_s, (int, float)) and 0 <= self.latency_s < math.inf):
            raise ConfigError(f"LatencyConfig.latency_s must be >= 0, got {self.latency_s!r}")
        _check_bandwidth("read_bandwidth_bps", self.read_bandwidth_bps)
        _check_bandwidth("write_bandwidth_bps", self.write_bandwidth_bps)


class _Link:
    """One direction of the modelled link: the time until which it is busy."""

    __slots__ = ("busy_until",)

    def __init__(self) -> None:
        self.busy_until = -math.inf


class LatencyBackend(WrapperBackend):
    """Delays calls to ``inner`` as a remote store behind a slow link would.

    Every call waits ``latency_s``; a get or put also waits for its bytes to cross the link,
    after any transfer already queued on it. The delay is computed from ``clock()`` and the
    link's state in one step with no await, so concurrent calls queue in call order; then the
    call awaits ``sleep(delay)``. Tests pass a fake ``sleep`` and ``clock``. Reads are done
    first and delayed after (their size is known only then); writes are delayed, then done.
    """

    name = "latency"
    config_type = LatencyConfig

    def __init__(
        self,
        inner: StorageBackend,
        config: LatencyConfig | None = None,
        *,
        sleep: SleepFn = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(inner)
        self.config = config or LatencyConfig()
        self._sleep = sleep
        self._clock = clock
        self._read_link = _Link()
        self._write_link = _Link()
        self._delayed_seconds = 0.0

    def _reserve(self, nbytes: int, link: _Link, bandwidth: float | None) -> float:
        """The delay of a call moving ``nbytes`` over ``link``, which it books."""
        now = self._clock()
        ready = now + self.config.latency_s
        if bandwidth is None or nbytes == 0:
            return ready - now
        start = max(ready, link.busy_until)
        link.busy_until = start + nbytes / bandwidth
        return link.busy_until - now

    async def _wait(self, delay: float) -> None:
        if delay > 0:
            self._delayed_seconds += delay
            await self._sleep(delay)

    async def _exists(self, keys: list[str]) -> list[bool]:
        await self._wait(self._reserve(0, self._read_link, None))
        return await self.inner.exists(keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        sizes = await self.inner.get_into(keys, buffers)
        moved = sum(
            n for n, segs in zip(sizes, buffers, strict=True) if 0 < n <= segments_nbytes(segs)
        )
        await self._wait(self._reserve(moved, self._read_link, self.config.read_bandwidth_bps))
        return sizes

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        moved = sum(segments_nbytes(segs) for segs in values)
        await self._wait(self._reserve(moved, self._write_link, self.config.write_bandwidth_bps))
        return await self.inner.put(keys, values)

    async def _delete(self, keys: list[str]) -> list[bool]:
        await self._wait(self._reserve(0, self._write_link, None))
        return await self.inner.delete(keys)

    def _wrapper_stats(self) -> dict[str, int | float]:
        return {"delayed_seconds": self._delayed_seconds}
