"""API keys, tenants and the admin plane, through a real HTTP client against a live server.

With keys configured every ``/v1`` request needs one (401 in OpenAI's error shape otherwise,
never echoing the key), ``/health`` stays open, ``/metrics`` needs a key unless public. The
tenant is the key's: two tenants, or two ``cache_salt`` values, share no cached page on any
tier, L3 across a restart included, unless ``--share-cache``. The admin routes exist only with
the admin key, and a tenant key on them is a 403. A request's ``priority`` is capped (by
default at 0; the key file raises it for a tenant), and the per-caller limits count a tenant's
keys together, or on a server without keys the client address whatever key it presents.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import secrets
from typing import Any

import httpx
import pytest
from http_kit import GREEDY, serving, slowed
from serving_kit import ENGINE, VOCAB

from hicache.server.app import HttpServer
from hicache.server.auth import Access, KeyRing
from hicache.server.limits import Limits

ALICE, BOB, ADMIN = "alice-key-0001", "bob-key-00002", "admin-key-0003"
KEYS = KeyRing({ALICE: "alice", BOB: "bob"})
PROMPT = [(7 * i + 3) % VOCAB for i in range(64)]
HERS = [(11 * i + 5) % VOCAB for i in range(64)]  # a prompt only alice sends


def http(server: HttpServer, key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.AsyncClient(base_url=server.url or "", timeout=30.0, headers=headers)


async def cached(server: HttpServer, key: str, prompt: list[int], **extra: Any) -> int:
    """Serve ``prompt`` as ``key``'s tenant; its ``cached_tokens``."""
    async with http(server, key) as client:
        body = {"prompt": prompt, "max_tokens": 1, **GREEDY, **extra}
        answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    tokens: int = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


async def test_requests_without_a_valid_key_get_a_401_that_does_not_echo_it() -> None:
    async with serving(None, access=Access(KEYS)) as server:
        for key in (None, "wrong-key-123456", ALICE[:-1]):
            async with http(server, key) as client:
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                    answer = await client.request(method, path, json={"prompt": [1, 2]})
                    assert answer.status_code == 401, (key, path)
                    error = answer.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["code"] == "invalid_api_key"
                    assert key is None or key not in answer.text
                assert (await client.get("/health")).status_code == 200  # always open
                assert (await client.get("/metrics")).status_code == 401
        async with http(server, BOB) as client:
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
            assert models["data"][0]["owned_by"] and models["data"][0]["created"] > 0
            assert (await client.get("/metrics")).status_code == 200
        assert await cached(server, ALICE, PROMPT[:20]) == 0


@pytest.mark.parametrize(
    "access",
    [Access(KEYS), Access(KEYS, admin_key="sk-admin-key-000009"), Access(internal_token="t" * 32)],
    ids=["keys", "keys-and-admin", "worker-behind-a-router"],
)
async def test_a_key_that_is_not_utf8_is_a_401_not_a_500(access: Access) -> None:
    """httpx sends header bytes as given: an Authorization with bytes that are not UTF-8, to
    every check that compares a key (tenant keys, the admin key, a worker's internal token)."""
    async with (
        serving(None, access=access) as server,
        httpx.AsyncClient(base_url=server.url or "", timeout=30.0) as client,
    ):
        for raw in (ALICE[:-1].encode() + b"\xff", b"\xff\xfe", b"\xc3\x28"):
            headers = [(b"Authorization", b"Bearer " + raw)]
            for path in ("/v1/completions", "/admin/flush"):
                answer = await client.post(path, json={"prompt": [1]}, headers=headers)
                assert answer.status_code in (401, 404), (path, raw, answer.text)
                assert answer.status_code == 401 or access.admin_key is None


async def test_metrics_can_be_public() -> None:
    async with (
        serving(None, access=Access(KEYS, metrics_public=True)) as server,
        http(server, None) as client,
    ):
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.post("/v1/completions", json={})).status_code == 401


async def test_tenants_and_salts_share_no_cached_page(tmp_path: pathlib.Path) -> None:
    async with serving(tmp_path / "l3", access=Access(KEYS)) as server:
        assert await cached(server, ALICE, PROMPT) == 0
        assert await cached(server, ALICE, PROMPT) > 0  # the same tenant hits its own prefix
        assert await cached(server, BOB, PROMPT) == 0  # another tenant's prefix is a miss
        assert await cached(server, ALICE, PROMPT, cache_salt="s1") == 0  # so is another salt
        assert await cached(server, ALICE, PROMPT, cache_salt="s1") > 0
        assert await cached(server, ALICE, HERS) == 0
        assert await cached(server, ALICE, PROMPT[::-1]) == 0
        # The user field names nobody's cache: bob stays bob.
        assert await cached(server, BOB, PROMPT[::-1], user="alice") == 0
        await server.setup.cache.quiesce(10)  # type: ignore[union-attr]
    # A new server over the same L3: alice's pages are hers only.
    async with serving(tmp_path / "l3", access=Access(KEYS)) as again:
        assert await cached(again, ALICE, HERS) > 0
        assert again.setup.engine.records[-1].hit_l3 > 0
        assert await cached(again, BOB, HERS[:40] + [3] * 24) == 0


async def test_share_cache_lets_tenants_hit_each_others_prefixes() -> None:
    async with serving(None, access=Access(KEYS, share_cache=True)) as server:
        assert await cached(server, ALICE, PROMPT) == 0
        assert await cached(server, BOB, PROMPT) > 0
        assert await cached(server, BOB, PROMPT, cache_salt="own") == 0  # the salt still counts


async def test_a_bad_cache_salt_is_a_400() -> None:
    async with serving(None, access=Access(KEYS)) as server, http(server, ALICE) as client:
        for salt in ("", "x" * 257, "tab\there", 7, ["a"]):
            body = {"prompt": PROMPT[:8], "cache_salt": salt}
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "cache_salt"


async def test_admin_routes_need_the_admin_key() -> None:
    async with serving(None, access=Access(KEYS)) as closed:  # no admin key: no admin plane
        for key in (ALICE, None):
            async with http(closed, key) as client:
                assert (await client.post("/admin/flush", json={})).status_code == 404
    async with serving(None, access=Access(KEYS, admin_key=ADMIN)) as server:
        for key, status in ((ALICE, 403), (None, 401), ("not-the-admin-key", 401), (ADMIN, 200)):
            async with http(server, key) as client:
                answer = await client.post("/admin/flush", json={})
            assert answer.status_code == status, (key, answer.text)
            if status != 200:
                assert answer.json()["error"]["code"] in ("forbidden", "invalid_api_key")
        # No --l3-allow prefix: every attach is refused, and the refusal keeps the secrets.
        async with http(server, ADMIN) as client:
            url = "s3://AKIDEXAMPLE:sEcReT-42@bucket/kv?endpoint_url=http://127.0.0.1:9&secret=zq9"
            answer = await client.post("/admin/l3/attach", json={"url": url})
        assert answer.status_code == 403 and "--l3-allow" in answer.text
        assert not any(s in answer.text for s in ("AKIDEXAMPLE", "sEcReT-42", "zq9"))


async def test_limits_answer_with_their_status_and_retry_after() -> None:
    limits = Limits(max_body_bytes=4096, max_tokens=8, max_queue=1, rate_per_s=1.0,
                    max_concurrent=1)  # fmt: skip
    async with serving(None, device_tokens=4096, access=Access(KEYS), limits=limits) as server:
        async with http(server, ALICE) as client:
            big = await client.post("/v1/completions", content=b"[" + b"1," * 4096 + b"1]")
            assert big.status_code == 413 and "error" in big.json()
            # Alice's bucket is empty now (a burst of one a second).
            fast = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            assert fast.status_code == 429 and int(fast.headers["Retry-After"]) >= 1
            assert fast.json()["error"]["code"] == "rate_limit_exceeded"
        async with http(server, BOB) as client:  # bob's bucket is his own
            many = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 9})
            assert many.status_code == 400 and many.json()["error"]["param"] == "max_tokens"
        # One request in flight fills the queue of one: the queue is checked first, a 503.
        hold = server.source.submit(PROMPT[:8], 4000)
        async with http(server, BOB) as client:
            busy = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
        server.source.cancel(hold)
        await hold.done


async def test_unknown_routes_and_methods_answer_in_openais_shape() -> None:
    async with serving(None, access=Access(KEYS)) as server, http(server, ALICE) as client:
        for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405),
                                     ("POST", "/admin/flush", 404)):  # fmt: skip
            answer = await client.request(method, path)
            assert answer.status_code == status
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


async def test_priority_is_capped_per_tenant(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{ALICE} alice max_priority=3\n{BOB} bob\n")
    async with serving(None, access=Access(KeyRing({}, path))) as server:

        async def ask(key: str, priority: int) -> httpx.Response:
            async with http(server, key) as client:
                body = {"prompt": PROMPT[:8], "max_tokens": 1, "priority": priority}
                return await client.post("/v1/completions", json=body)

        over = await ask(BOB, 1)  # no cap of bob's own: the server's default, 0
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["param"] == "priority" and "at most 0" in error["message"]
        assert (await ask(BOB, 0)).status_code == 200
        assert (await ask(BOB, -7)).status_code == 200  # lowering one's own priority is free
        assert (await ask(ALICE, 3)).status_code == 200  # the key file raises alice's cap
        assert (await ask(ALICE, 4)).status_code == 400
        path.write_text(f"{ALICE} alice max_priority=5\n{BOB} bob\n")
        server.access.keys.reload()  # SIGHUP: the new cap holds
        assert (await ask(ALICE, 5)).status_code == 200
        assert (await ask(BOB, 1)).status_code == 400


async def test_a_tenants_keys_share_one_rate_limit() -> None:
    keys = KeyRing({ALICE: "alice", "alice-key-0004": "alice", BOB: "bob"})
    async with serving(None, access=Access(keys), limits=Limits(rate_per_s=1.0)) as server:
        statuses = []
        for key in (ALICE, "alice-key-0004", BOB):
            async with http(server, key) as client:
                body = {"prompt": PROMPT[:8], "max_tokens": 1}
                statuses.append((await client.post("/v1/completions", json=body)).status_code)
        assert statuses == [200, 429, 200]  # alice's second key finds her bucket empty


async def test_without_keys_a_new_bearer_string_is_no_new_bucket() -> None:
    async with serving(None, access=Access(), limits=Limits(rate_per_s=1.0)) as server:
        statuses = []
        for _ in range(3):
            async with http(server, secrets.token_hex(12)) as client:
                body = {"prompt": PROMPT[:8], "max_tokens": 1}
                statuses.append((await client.post("/v1/completions", json=body)).status_code)
        assert statuses == [200, 429, 429]  # one client address, one bucket


async def test_tenants_take_turns_for_the_slots_that_free() -> None:
    """Bob has two requests running and a third queued when alice's arrives: the next slot
    that frees is hers (she has none running), not his third's, although his came first."""
    engine = dataclasses.replace(ENGINE, max_running=2)
    async with serving(None, device_tokens=1024, engine=engine, access=Access(KEYS)) as server:
        slowed(server, 0.01)  # each step 10 ms or more: the order is the engine's, not the clock's
        async with http(server, BOB) as bob, http(server, ALICE) as alice:
            lengths = {"short": (11, 20), "long": (12, 200), "third": (13, 20)}
            bobs = [asyncio.create_task(bob.post("/v1/completions", json={
                "prompt": [5] * n, "max_tokens": tokens, "temperature": 0}))
                for n, tokens in lengths.values()]  # fmt: skip
            while server.source.in_flight < 3:
                await asyncio.sleep(0.002)
            hers = {"prompt": [9] * 14, "max_tokens": 1, "temperature": 0}
            assert (await alice.post("/v1/completions", json=hers)).status_code == 200
            assert all(a.status_code == 200 for a in await asyncio.gather(*bobs))
        admitted = {r.prompt_tokens: r.admitted_s for r in server.setup.engine.records}
        assert admitted[14] < admitted[13]  # alice before bob's third
