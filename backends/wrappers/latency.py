"""Latency and bandwidth: a wrapper that delays calls as a remote store behind a slow link would.

:class:`LatencyBackend` takes an injectable clock and sleep so that tests run on fake time.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache.backends.base import StorageBackend, segments_nbytes
from hicache.backends.wrappers.base import SleepFn, WrapperBackend
from hicache.errors import ConfigError

__all__ = ["LatencyBackend", "LatencyConfig"]


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
