"""Request limits of the HTTP server: body size, tokens and priority asked for, queue depth,
and per-caller rate and concurrency.

Limited by default: the body (16 MiB), ``max_tokens`` (4096), the requests in flight on the
server (1024), open connections (1024, and 256 from one client address), the time a request
head, a body and a stream's chunk may take, and ``priority`` (at most 0, see
:func:`~hicache.server.auth.priority_cap`). Not limited by default: the rate and concurrency of
one caller (``rate_per_s`` and ``max_concurrent`` are None until ``--rate-limit`` and
``--max-concurrent`` set them), so one tenant may take the whole queue.

A caller is a tenant (all of its keys share its limits) or, for a request without one (a
server without keys, or the admin key on ``/v1``), its client address: on a server without
keys a presented ``Authorization`` string is ignored, so sending a new one each time escapes
nothing. Each caller has a token bucket (``rate_per_s`` requests a second, bursts of as many,
at least one) and a count of its requests in flight (``max_concurrent``). A refusal carries how
long to wait before a retry can succeed (``Retry-After``). At most ``_MAX_CALLERS`` callers are
tracked, the longest idle forgotten first, so a flood of addresses cannot grow the table
without bound.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from hicache.errors import ConfigError
from hicache.server.auth import Access, current_tenant, priority_cap
from hicache.server.request_body import ApiError

__all__ = ["CallerLimiter", "Limits", "caller_of", "check_priority"]

_MAX_CALLERS = 65536


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 16 << 20  # a request body past it is a 413
    max_tokens: int = 4096  # the most max_tokens a request may ask for (else a 400)
    max_queue: int = 1024  # requests in flight, queued or running; past it a 503
    rate_per_s: float | None = None  # requests a second per caller; past it a 429
    max_concurrent: int | None = None  # requests in flight per caller; past it a 429
    max_connections: int = 1024  # open connections; past it a new one is closed at once
    max_connections_per_client: int = 256  # of them from one client address (not a worker's)
    header_timeout_s: float = 10.0  # a connection's first request head must arrive by then
    body_timeout_s: float = 30.0  # a request body must arrive by then (else a 408)
    write_timeout_s: float = 30.0  # a stream's client must take each chunk by then (else dropped)

    def __post_init__(self) -> None:
        positive = ("max_body_bytes", "max_tokens", "max_queue", "max_connections",
                    "max_connections_per_client")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        rate = self.rate_per_s
        if rate is not None and (not math.isfinite(rate) or rate <= 0):
            raise ConfigError(f"rate_per_s must be a positive number, got {rate!r}")
        for name in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
            seconds = getattr(self, name)
            if not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
                raise ConfigError(f"{name} must be a positive number of seconds, got {seconds!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ConfigError(f"max_concurrent must be at least 1, got {self.max_concurrent!r}")


@dataclass(slots=True)
class _Caller:
    tokens: float
    stamp: float
    in_flight: int = 0


class CallerLimiter:
    """Rate and concurrency per caller, as :class:`Limits` sets them."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._callers: OrderedDict[str, _Caller] = OrderedDict()

    def admit(self, caller: str) -> float | None:
        """Take a slot for one request of ``caller``: None if taken, else the seconds until a
        retry may succeed (nothing is taken then)."""
        now, limits = self._clock(), self.limits
        state = self._state(caller, now)
        if limits.max_concurrent is not None and state.in_flight >= limits.max_concurrent:
            return 1.0  # a slot frees when one of its requests ends: no better estimate
        if limits.rate_per_s is not None:
            burst = max(1.0, limits.rate_per_s)
            state.tokens = min(burst, state.tokens + (now - state.stamp) * limits.rate_per_s)
            state.stamp = now
            if state.tokens < 1.0:
                return (1.0 - state.tokens) / limits.rate_per_s
            state.tokens -= 1.0
        state.in_flight += 1
        return None

    def take(self, caller: str) -> None:
        """:meth:`admit`, raising the 429 (with its retry delay) when refused."""
        wait = self.admit(caller)
        if wait is not None:
            raise ApiError("too many requests from this caller: retry shortly", None, 429,
                           "rate_limit_exceeded", retry_after_s=wait)  # fmt: skip

    def release(self, caller: str) -> None:
        """End one admitted request of ``caller``."""
        state = self._callers.get(caller)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def _state(self, caller: str, now: float) -> _Caller:
        state = self._callers.get(caller)
        if state is None:
            burst = max(1.0, self.limits.rate_per_s or 1.0)
            state = self._callers[caller] = _Caller(burst, now)
            self._forget_idle()
        self._callers.move_to_end(caller)
        return state

    def _forget_idle(self) -> None:
        while len(self._callers) > _MAX_CALLERS:
            oldest = next(iter(self._callers))
            if self._callers[oldest].in_flight:  # busy callers stay; move on past them
                self._callers.move_to_end(oldest)
                if all(c.in_flight for c in self._callers.values()):
                    return
                continue
            del self._callers[oldest]


def caller_of(request: web.Request) -> str:
    """Whose limits a request counts against: its tenant's (as the access middleware found it,
    so this runs inside the handler), else its client address's."""
    tenant = current_tenant()
    return f"tenant:{tenant}" if tenant is not None else f"addr:{request.remote}"


def check_priority(priority: int, access: Access, tenant: str | None) -> None:
    """Raise the 400 (param ``priority``) for a ``priority`` over ``tenant``'s cap."""
    cap = priority_cap(access, tenant)
    if priority > cap:
        raise ApiError(f"priority is at most {cap} here", "priority")
