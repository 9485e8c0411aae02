"""Per-caller rate and concurrency limits, on a fake clock."""

from __future__ import annotations

import pytest

from hicache.errors import ConfigError
from hicache.server.limits import CallerLimiter, Limits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_rate_limit_refuses_past_its_burst_and_says_when_to_retry() -> None:
    clock = Clock()
    limiter = CallerLimiter(Limits(rate_per_s=2.0), clock)
    assert limiter.admit("a") is None and limiter.admit("a") is None  # a burst of 2
    wait = limiter.admit("a")
    assert wait == pytest.approx(0.5)  # one token comes back in half a second
    assert limiter.admit("b") is None  # another caller has its own bucket
    clock.now += 0.5
    assert limiter.admit("a") is None and limiter.admit("a") is not None
    clock.now += 60
    assert [limiter.admit("a") for _ in range(3)].count(None) == 2  # refilled to the burst only


def test_concurrency_is_counted_until_release() -> None:
    limiter = CallerLimiter(Limits(max_concurrent=2), Clock())
    assert limiter.admit("a") is None and limiter.admit("a") is None
    assert limiter.admit("a") == 1.0
    limiter.release("a")
    assert limiter.admit("a") is None
    limiter.release("nobody")  # a release of an unknown caller changes nothing
    assert limiter.admit("a") == 1.0


def test_a_refused_request_takes_nothing() -> None:
    limiter = CallerLimiter(Limits(rate_per_s=1.0, max_concurrent=1), Clock())
    assert limiter.admit("a") is None
    assert limiter.admit("a") is not None  # concurrency: refused before the bucket is touched
    limiter.release("a")
    assert limiter.admit("a") is not None  # the bucket is empty: refused, no slot taken
    limiter.release("a")  # nothing was taken: no slot goes negative
    assert limiter._callers["a"].in_flight == 0


@pytest.mark.parametrize(
    "bad", [{"max_body_bytes": 0}, {"max_tokens": -1}, {"max_queue": True},
            {"rate_per_s": 0.0}, {"rate_per_s": float("inf")}, {"max_concurrent": 0}],
)  # fmt: skip
def test_bad_limits_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Limits(**bad)  # type: ignore[arg-type]
