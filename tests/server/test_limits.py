"""Per-caller rate and concurrency limits, on a fake clock; whose limits a request counts
against, through the access middleware; the priority cap's refusal."""

from __future__ import annotations

import secrets

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from clock_kit import FakeClock

from hicache.errors import ConfigError
from hicache.server.auth import Access, KeyRing, access_middleware
from hicache.server.limits import CallerLimiter, Limits, caller_of, check_priority
from hicache.server.request_body import ApiError


def test_a_rate_limit_refuses_past_its_burst_and_says_when_to_retry() -> None:
    clock = FakeClock(100.0)
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
    limiter = CallerLimiter(Limits(max_concurrent=2), FakeClock(100.0))
    assert limiter.admit("a") is None and limiter.admit("a") is None
    assert limiter.admit("a") == 1.0
    limiter.release("a")
    assert limiter.admit("a") is None
    limiter.release("nobody")  # a release of an unknown caller changes nothing
    assert limiter.admit("a") == 1.0


def test_a_refused_request_takes_nothing() -> None:
    limiter = CallerLimiter(Limits(rate_per_s=1.0, max_concurrent=1), FakeClock(100.0))
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


async def callers(access: Access, keys: list[str | None]) -> list[str]:
    """The caller each request (presenting each of ``keys``) counts against, as a handler
    behind the access middleware finds it."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=caller_of(request))

    app = web.Application(middlewares=[access_middleware(access)])
    app.router.add_post("/v1/completions", handler)
    found = []
    async with TestClient(TestServer(app)) as client:
        for key in keys:
            headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
            answer = await client.post("/v1/completions", headers=headers)
            assert answer.status == 200
            found.append(await answer.text())
    return found


async def test_the_keys_of_one_tenant_share_its_limits() -> None:
    keys = KeyRing({"alice-key-0001": "alice", "alice-key-0002": "alice", "bob-key-00003": "bob"})
    first, second, bob = await callers(
        Access(keys), ["alice-key-0001", "alice-key-0002", "bob-key-00003"]
    )
    assert first == second == "tenant:alice" and bob == "tenant:bob"


async def test_without_keys_every_bearer_string_counts_against_the_address() -> None:
    """On a keyless server a client sending a new random key each time must not get a new
    bucket each time."""
    presented = [None, *(secrets.token_hex(8) for _ in range(3))]
    found = await callers(Access(), presented)
    assert set(found) == {"addr:127.0.0.1"}


def test_a_priority_over_the_cap_is_a_400_naming_it() -> None:
    check_priority(0, Access(), None)
    check_priority(-5, Access(), None)  # lowering one's own priority needs no say-so
    with pytest.raises(ApiError) as refused:
        check_priority(1, Access(), None)
    assert refused.value.status == 400 and refused.value.param == "priority"
    assert "at most 0" in str(refused.value)
    check_priority(4, Access(max_priority=4), "alice")
