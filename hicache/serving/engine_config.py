"""The engine's configuration: cache modes, engine settings, and where requests come from."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Protocol

from hicache.errors import InvalidArgumentError
from hicache.radix.eviction import EvictionPolicy
from hicache.scheduling.host_weight import DEFAULT_HOST_HIT_WEIGHT, check_host_hit_weight
from hicache.scheduling.scheduler import SchedulePolicy
from hicache.serving.request import ServeRequest
from hicache.sparse.hot_buffer import HiSparseConfig

__all__ = ["CacheMode", "EngineConfig", "RequestSource"]


class CacheMode(enum.Enum):
    NONE = "none"  # every prompt computed in full
    DEVICE = "device"  # RadixAttention on the device pool only
    DEVICE_HOST = "device+host"
    DEVICE_HOST_L3 = "device+host+l3"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running: int = 8
    chunk_tokens: int = 512  # prefill chunk
    schedule: SchedulePolicy = SchedulePolicy.LPM
    temperature: float = 0.0  # 0: greedy
    sample_seed: int = 0
    skip_slow_prefetch: bool = True  # skip a prefetch that would take longer than prefill
    stall_s: float = 60.0  # a request that cannot be admitted with nothing running this long fails
    hisparse: HiSparseConfig | None = None  # DSA decode from a hot buffer (needs a host tier)
    eviction: EvictionPolicy = EvictionPolicy.LRU  # of the device tree (and host, its order)
    delay_prefill: bool = False  # hold prefill briefly while queued requests share prefixes
    host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT  # a host hit's worth to LPM / DFS_WEIGHT

    def __post_init__(self) -> None:
        for name, limit in (("max_running", 1 << 16), ("chunk_tokens", 1 << 30)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= limit:
                raise InvalidArgumentError(f"{name} must be an int in [1, {limit}], got {value!r}")
        # Written so that NaN fails too.
        if not (isinstance(self.temperature, int | float) and 0 <= self.temperature < math.inf):
            raise InvalidArgumentError(
                f"temperature must be finite and >= 0, got {self.temperature!r}"
            )
        if not (isinstance(self.stall_s, int | float) and 0 < self.stall_s < math.inf):
            raise InvalidArgumentError(f"stall_s must be finite and > 0, got {self.stall_s!r}")
        check_host_hit_weight(self.host_hit_weight)


class RequestSource(Protocol):
    """Where requests come from: arrivals by time, and follow-ups when one finishes."""

    def due(self, now: float) -> list[ServeRequest]: ...
    def finished(self, request: ServeRequest, now: float) -> None: ...
    def next_arrival(self) -> float | None: ...
