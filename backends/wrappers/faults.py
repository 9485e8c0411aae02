"""Fault injection: a wrapper that fails, stalls or corrupts calls, reproducibly by seed.

:class:`FaultInjectionBackend` lets tests drive the cache controller against unreliable storage.
"""

from __future__ import annotations

import asyncio
import enum
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from hicache.backends.base import MISS, StorageBackend, join_segments, segments_nbytes
from hicache.backends.wrappers.base import SleepFn, WrapperBackend
from hicache.errors import BackendUnavailableError, ConfigError, InvalidArgumentError

__all__ = ["FaultConfig", "FaultInjectionBackend", "FaultMode", "Operation"]

T = TypeVar("T")


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
        # Bytes it corrupts after the inner backend read them were checked by nobody.
        self.capabilities = replace(self.capabilities, checks_pages_over=None)
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

    async def _keys_only(
        self, op: Operation, keys: list[str], call: Callable[[list[str]], Awaitable[list[bool]]]
    ) -> list[bool]:
        """``call`` (the inner ``exists`` or ``delete``) with ``op``'s faults: a failed key is
        False without reaching the inner backend."""
        plan = self._plan(op, len(keys))
        if plan is None:
            return await call(keys)
        await self._begin(op, plan)
        kept = [k for k, f in zip(keys, plan.failed, strict=True) if not f]
        return _scatter(plan.failed, await call(kept) if kept else [], False)

    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self._keys_only(Operation.EXISTS, keys, self.inner.exists)

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
        return await self._keys_only(Operation.DELETE, keys, self.inner.delete)

    def _wrapper_stats(self) -> dict[str, int | float]:
        return dict(self._faults)
