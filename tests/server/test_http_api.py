"""The OpenAI-compatible endpoint through a real HTTP client (httpx), against a server on a free
port of 127.0.0.1 in this process: answers equal the engine's own run of the same prompts,
streaming gives the same tokens, bad requests get a 400 and the server goes on, ``/metrics``
parses with prometheus-client's parser, and a shutdown drains what is in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from http_kit import ADMIN_KEY, DENSE, GREEDY, client, serving, slowed, start, stop
from prometheus_client.parser import text_string_to_metric_families
from serving_kit import ENGINE, PAGE, VOCAB, serve, trace

from hicache.radix.eviction import EvictionPolicy
from hicache.server.app import HttpServer
from hicache.server.auth import Access
from hicache.serving.engine import CacheMode

PROMPTS = [[7 + i] * 24 + list(range(10, 10 + 4 * i)) for i in range(4)]


@pytest.fixture
async def server(tmp_path: pathlib.Path) -> AsyncIterator[HttpServer]:
    running = await start(tmp_path / "l3")
    yield running
    if not running.task.done():  # type: ignore[attr-defined]
        await stop(running)


async def test_completions_equal_the_engines_own_run(server: HttpServer) -> None:
    want = await serve(DENSE, CacheMode.NONE, trace(PROMPTS, output_tokens=4))
    async with client(server) as http:
        answers = await asyncio.gather(*(
            http.post("/v1/completions", json={"prompt": p, "max_tokens": 4, **GREEDY})
            for p in PROMPTS
        ))  # fmt: skip
    for i, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        choice = body["choices"][0]
        assert choice["token_ids"] == want.outputs[f"t{i}"]
        assert choice["finish_reason"] == "length" and body["model"] == "tiny"
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPTS[i]), 4)
        assert usage["total_tokens"] == len(PROMPTS[i]) + 4
        details = usage["prompt_tokens_details"]
        tiers = details["device"] + details["host"] + details["l3"]
        assert details["cached_tokens"] == tiers < len(PROMPTS[i])


async def test_streaming_sends_each_token_then_done(server: HttpServer) -> None:
    async with client(server) as http:
        whole = await http.post(
            "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 5, **GREEDY}
        )
        events = []
        body = {"prompt": PROMPTS[1], "max_tokens": 5, "stream": True, **GREEDY}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == whole.json()["choices"][0]["token_ids"] and len(streamed) == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5


async def test_bad_requests_get_a_400_and_the_server_goes_on(server: HttpServer) -> None:
    bad = [
        b"{not json",
        json.dumps({"prompt": [1, 2], "frequency_penalty": 1}).encode(),
        json.dumps({"prompt": [1, VOCAB]}).encode(),
        json.dumps({"prompt": [1, 2], "max_tokens": 0}).encode(),
        json.dumps({"prompt": [1] * 200, "max_tokens": 4}).encode(),  # over the 128-token pool
        json.dumps({"prompt": "text without a tokenizer"}).encode(),
        b"[" * 100_000 + b"]" * 100_000,  # nested deeper than Python's recursion limit
        b'{"prompt": [1, 2], "max_tokens": ' + b"9" * 5000 + b"}",  # over int()'s 4,300 digits
        b'{"prompt": [1, 2], "seed": 1' + b"0" * 4400 + b"}",
        b"\xff\xfe{}",  # not UTF-8
    ]
    async with client(server) as http:
        for body in bad:
            answer = await http.post("/v1/completions", content=body)
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["message"]
        ok = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
        health = await http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert "over" not in ok.text  # the last answer is a normal one
    refused = server.metrics.sample("hicache_requests_total", {"outcome": "refused"})
    assert refused == len(bad)


async def test_metrics_parse_and_count_what_was_served(server: HttpServer) -> None:
    async with client(server) as http:
        for _ in range(2):  # the second sends the same prompt: a device hit
            answer = await http.post(
                "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 2}
            )
            assert answer.status_code == 200
        text = (await http.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}  # fmt: skip
    assert samples[("hicache_requests_total", (("outcome", "ok"),))] == 2
    assert samples[("hicache_ttft_seconds_count", ())] == 2
    assert samples[("hicache_queue_seconds_count", ())] == 2
    assert samples[("hicache_prompt_tokens_total", ())] == 2 * len(PROMPTS[3])
    assert samples[("hicache_generated_tokens_total", ())] == 4
    hit = len(PROMPTS[3]) - len(PROMPTS[3]) % PAGE  # whole pages, the last token recomputed
    assert samples[("hicache_request_hit_tokens_total", (("tier", "device"),))] >= hit - PAGE
    for name in (
        "hicache_device_hit_tokens",
        "hicache_bytes_host_to_l3",
        "hicache_prefetch_complete",
        "hicache_l3_read_bytes_per_s",
        "hicache_l3_write_bytes_per_s",
    ):
        assert name in families, name  # the tiered cache's counters, per tier and reason


async def test_shutdown_drains_in_flight_requests_and_l3_writes(tmp_path: pathlib.Path) -> None:
    server = await start(tmp_path / "l3")
    async with client(server) as http:
        pending = [
            asyncio.create_task(http.post("/v1/completions", json={"prompt": p, "max_tokens": 6}))
            for p in PROMPTS
        ]
        for _ in range(1000):
            if server.source.in_flight == len(PROMPTS):
                break
            await asyncio.sleep(0.005)
        server.stop()  # while they run
        answers = await asyncio.gather(*pending)
        await asyncio.wait_for(server.task, 30)  # type: ignore[attr-defined]
    assert [a.status_code for a in answers] == [200] * len(PROMPTS)
    assert all(len(a.json()["choices"][0]["token_ids"]) == 6 for a in answers)
    assert server.setup.cache is not None and server.setup.cache.storage.queued_pages == 0
    written = server.metrics.sample("hicache_pages_written_l3_total")
    assert written is not None and written > 0
    rate = server.metrics.sample("hicache_l3_write_bytes_per_s")
    assert rate is not None and rate > 0
    assert any((tmp_path / "l3").rglob("*")), "nothing reached the L3 directory"


# ----- admin endpoints and request priority ------------------------------------------------------
async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post(path, json=body)


async def device_hit(http: httpx.AsyncClient, server: HttpServer, prompt: list[int]) -> int:
    """Serve ``prompt``; the device hit tokens its request had."""
    answer = await post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return server.setup.engine.records[-1].hit_device


async def test_pin_keeps_a_prefix_through_a_flush() -> None:
    async with serving(None) as server, client(server) as http:
        await post(http, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 1})
        await post(http, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 1})
        pin = await post(http, "/admin/pin", {"prompt": PROMPTS[0], "ttl_s": 60})
        assert pin.status_code == 200 and pin.json()["pinned_tokens"] >= 16
        flushed = await post(http, "/admin/flush", {})
        assert flushed.status_code == 200 and flushed.json()["dropped_tokens"] > 0
        assert await device_hit(http, server, PROMPTS[0]) >= 16  # pinned: still there
        assert await device_hit(http, server, PROMPTS[1]) == 0  # flushed
        for body in ({"prompt": PROMPTS[0], "ttl_s": 0}, {"prompt": [VOCAB], "ttl_s": 5}):
            bad = await post(http, "/admin/pin", body)
            assert bad.status_code == 400, bad.text


async def test_l3_detach_and_attach_at_run_time(tmp_path: pathlib.Path) -> None:
    access = Access(admin_key=ADMIN_KEY, l3_allow=(f"file://{tmp_path}/",))
    async with serving(tmp_path / "l3", access=access) as server:
        async with client(server) as http:
            detached = await post(http, "/admin/l3/detach", {})
            assert detached.json() == {"l3": None, "detached": True}
            cache = server.setup.cache
            assert cache is not None and not cache.storage.enabled
            await post(http, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 1})
            assert not any(n.in_storage for n in cache.all_nodes())  # nothing written
            outside = await post(http, "/admin/l3/attach", {"url": "file:///tmp/elsewhere"})
            assert outside.status_code == 403 and "--l3-allow" in outside.text
            for bypass in ("x?read_only=true", "x?io_threads=1000000", "%252e%252e/x"):
                url = f"file://{tmp_path}/{bypass}"  # options the rule lacks, an encoded ..
                refused = await post(http, "/admin/l3/attach", {"url": url})
                assert refused.status_code == 403, (bypass, refused.text)
            bad = await post(http, "/admin/l3/attach", {"url": f"file://{tmp_path}/x?nosuch=1"})
            assert bad.status_code == 400 and not cache.storage.enabled
            other = tmp_path / "other"
            attached = await post(http, "/admin/l3/attach", {"url": f"file://{other}"})
            assert attached.status_code == 200, attached.text
            again = await post(http, "/admin/l3/attach", {"url": f"file://{other}"})
            assert again.status_code == 400 and "detach it first" in again.text
            await post(http, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 1})
            await cache.quiesce(10)
        assert any(other.rglob("*")), "nothing written to the attached L3"


async def test_priority_admits_first_and_its_pages_are_evicted_last() -> None:
    engine = dataclasses.replace(ENGINE, eviction=EvictionPolicy.PRIORITY, max_running=1)
    access = Access(admin_key=ADMIN_KEY, max_priority=5)  # raising priority is the operator's
    options = {"device_tokens": 96, "mode": CacheMode.DEVICE, "engine": engine, "access": access}
    async with serving(None, **options) as server, client(server) as http:
        important = [3] * 40
        await post(http, "/v1/completions", {"prompt": important, "max_tokens": 1,
                                             "priority": 5})  # fmt: skip
        for i in range(4):  # low priority, enough to evict everything evictable twice
            await post(http, "/v1/completions", {"prompt": [50 + i] * 40, "max_tokens": 1})
        assert await device_hit(http, server, important) >= 32
        bad = await post(http, "/v1/completions", {"prompt": [1], "priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


async def test_text_prompts_and_answers_with_a_tokenizer() -> None:
    """A real tokenizers WordLevel tokenizer: the text prompt is its word ids, and the answer's
    text is its tokens decoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "the", "cat", "sat", "on", "mat"] + [f"w{i}" for i in range(6, VOCAB)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    async with serving(None, tokenizer=tokenizer) as server:
        async with client(server) as http:
            text = await post(http, "/v1/completions", {"prompt": "the cat sat on the mat",
                                                        "max_tokens": 3, **GREEDY})  # fmt: skip
            ids = await post(http, "/v1/completions", {"prompt": [1, 2, 3, 4, 1, 5],
                                                       "max_tokens": 3, **GREEDY})  # fmt: skip
        assert text.status_code == ids.status_code == 200, text.text
        choice = text.json()["choices"][0]
        assert choice["token_ids"] == ids.json()["choices"][0]["token_ids"]
        assert choice["text"] == tokenizer.decode(choice["token_ids"]) and choice["text"]
        assert text.json()["usage"]["prompt_tokens"] == 6


# ----- clients that go away -----------------------------------------------------------------------
async def record_of(server: HttpServer, rid: str) -> Any:
    for _ in range(500):
        found = [r for r in server.setup.engine.records if r.rid == rid and r.error is not None]
        if found:
            return found[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"{rid} was never cancelled")


async def test_a_stream_whose_client_hangs_up_is_cancelled() -> None:
    async with serving(None, device_tokens=512) as server:
        slowed(server)  # 200 tokens: 2 s at least
        async with client(server) as http:
            body = {"prompt": PROMPTS[0], "max_tokens": 200, "stream": True, **GREEDY}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        break  # hang up mid-stream
            record = await record_of(server, "http-0")
            assert record.error == "cancelled: the client went away"
            assert 3 <= record.output_tokens < 200
            ok = await post(http, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
            assert ok.status_code == 200  # the server goes on, its slots free again
        assert server.metrics.sample("hicache_requests_total", {"outcome": "failed"}) == 1


async def test_a_whole_answer_whose_client_hangs_up_is_cancelled() -> None:
    async with serving(None, device_tokens=512) as server:
        slowed(server)  # 300 tokens: 3 s at least; the client gives up after 0.3 s
        async with httpx.AsyncClient(base_url=server.url or "", timeout=0.3) as http:
            body = {"prompt": PROMPTS[1], "max_tokens": 300, **GREEDY}
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body)
        record = await record_of(server, "http-0")
        assert record.output_tokens < 300


async def test_a_cancelled_request_leaves_the_queue_before_it_runs() -> None:
    async with serving(None, engine=dataclasses.replace(ENGINE, max_running=1)) as server:
        source = server.source
        first = source.submit(PROMPTS[0], 20, 0.0)
        second = source.submit(PROMPTS[1], 20, 0.0)
        source.cancel(second)
        dropped = await asyncio.wait_for(second.done, 30)
        assert dropped.record.error == "cancelled: the client went away"
        assert dropped.generated == [] and dropped.record.admitted_s is None
        served = await asyncio.wait_for(first.done, 30)
        assert served.record.error is None and len(served.generated) == 20
        source.cancel(first)  # done already: nothing happens
        assert not first.request.cancelled
