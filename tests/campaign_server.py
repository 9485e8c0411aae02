"""The hostile-client campaign against a real ``hicache serve --http`` (issue 35).

``python tests/campaign_server.py [--ttft-rounds N]`` starts a server on 127.0.0.1 with two
tenant keys, an admin key, an L3 allow-list and request limits, then plays every refusal a
public endpoint must make: no key, a wrong key, a tenant key on an admin route, an attach
outside the allow-list and one whose URL holds secrets, cross-tenant and cross-salt prompts,
oversized bodies, 200 slow-header connections, a flood past the rate limit, and streams
dropped mid-way. It prints one line of counts and, last, the cross-tenant TTFT ratio: tenant
B's time to first token on tenant A's (cached) prompt over B's on a fresh prompt of the same
length, the median of N rounds (about 1 when nothing is shared). Exits 1 when a secret leaked,
a cross-tenant hit happened, the server died, or a refusal had the wrong status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ALICE, BOB, ADMIN = "sk-alice-campaign-1", "sk-bob-campaign-02", "sk-admin-campaign-3"
SECRETS = ("AKIDCAMPAIGN", "sEcReT-campaign", "zq9-token")
MODEL = ["--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim",
         "64", "--vocab", "4096", "--device-tokens", "16384"]  # fmt: skip


@dataclass
class Tally:
    tried: int = 0
    refused_right: int = 0
    expected_refusals: int = 0
    secrets_leaked: int = 0
    cross_tenant_hits: int = 0
    crashes: int = 0
    wrong: list[str] = field(default_factory=list)

    def refusal(self, what: str, answer: httpx.Response, status: int) -> None:
        self.tried += 1
        self.expected_refusals += 1
        if answer.status_code == status:
            self.refused_right += 1
        else:
            self.wrong.append(f"{what}: {answer.status_code}, wanted {status}")
        if any(s in answer.text for s in SECRETS):
            self.secrets_leaked += 1


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def completion(client: httpx.AsyncClient, key: str, prompt: list[int], **extra: Any) -> Any:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    return await client.post("/v1/completions", json=body, headers=headers(key))


def cached(answer: httpx.Response) -> int:
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def refusals(client: httpx.AsyncClient, tally: Tally, l3_root: pathlib.Path) -> None:
    tally.refusal("no key", await completion(client, "", [1, 2, 3]), 401)
    tally.refusal("wrong key", await completion(client, "sk-wrong-key-000", [1, 2, 3]), 401)
    answer = await client.post("/admin/flush", json={}, headers=headers(ALICE))
    tally.refusal("tenant key on admin", answer, 403)
    outside = {"url": "file:///tmp/hicache-campaign-elsewhere"}
    answer = await client.post("/admin/l3/attach", json=outside, headers=headers(ADMIN))
    tally.refusal("attach outside the allow-list", answer, 403)
    url = (f"s3://{SECRETS[0]}:{SECRETS[1]}@bucket/kv?endpoint_url=http://127.0.0.1:9"
           f"&token={SECRETS[2]}")  # fmt: skip
    answer = await client.post("/admin/l3/attach", json={"url": url}, headers=headers(ADMIN))
    tally.refusal("attach with secrets", answer, 403)
    inside = {"url": f"file://{l3_root}/allowed/x?secret={SECRETS[2]}"}
    answer = await client.post("/admin/l3/attach", json=inside, headers=headers(ADMIN))
    tally.refusal("attach an L3 that fails, with a secret", answer, 400)
    body = b"[" + b"1," * 40_000 + b"1]"
    answer = await client.post("/v1/completions", content=body, headers=headers(BOB))
    tally.refusal("oversized body", answer, 413)
    answer = await completion(client, BOB, [1, 2], cache_salt="")
    tally.refusal("bad cache_salt", answer, 400)


async def isolation(client: httpx.AsyncClient, tally: Tally) -> None:
    for i in range(5):
        prompt = [(97 * i + 7 * j) % 4000 for j in range(256)]
        await completion(client, ALICE, prompt)
        again = await completion(client, ALICE, prompt)  # alice hits her own prefix
        bob = await completion(client, BOB, prompt)
        salted = await completion(client, ALICE, prompt, cache_salt="other")
        tally.tried += 4
        if cached(again) == 0:
            tally.wrong.append("alice missed her own prefix")
        tally.cross_tenant_hits += int(cached(bob) > 0) + int(cached(salted) > 0)


async def slow_headers_and_flood(client: httpx.AsyncClient, url: str, tally: Tally) -> float:
    """200 connections that never finish their headers, 100 requests past the rate limit;
    meanwhile the time /health takes, which is returned."""
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(200):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        sockets.append(writer)
    flood = [completion(client, BOB, [5, 6, 7]) for _ in range(100)]
    started = time.perf_counter()
    health = await client.get("/health")
    health_s = time.perf_counter() - started
    answers = await asyncio.gather(*flood)
    honest = await completion(client, ALICE, [9, 9, 9])
    tally.tried += 102
    limited = sum(a.status_code == 429 for a in answers)
    if limited == 0 or any(a.status_code not in (200, 429) for a in answers):
        tally.wrong.append(f"flood: {limited} of 100 got a 429")
    tally.expected_refusals += limited
    tally.refused_right += limited
    if health.status_code != 200 or honest.status_code != 200:
        tally.wrong.append(f"health {health.status_code}, honest {honest.status_code}")
    for writer in sockets:
        writer.close()
    return health_s


async def dropped_streams(url: str, tally: Tally) -> None:
    for _ in range(5):
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            body = {"prompt": [3, 4, 5], "max_tokens": 200, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers=headers(ALICE)) as response:  # fmt: skip
                async for _ in response.aiter_lines():
                    break  # one line, then hang up
        tally.tried += 1
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        for _ in range(100):
            if (await client.get("/health")).json()["in_flight"] == 0:
                return
            await asyncio.sleep(0.1)
    tally.wrong.append("dropped streams stayed in flight")


async def ttft(client: httpx.AsyncClient, key: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers=headers(key)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended before its first token")


async def cross_tenant_ttft(client: httpx.AsyncClient, rounds: int) -> list[float]:
    """Per round: bob's TTFT on alice's cached prompt over his TTFT on a fresh one."""
    ratios = []
    for r in range(rounds):
        hers = [(13 * r + 5 * j + 1) % 4000 for j in range(4096)]
        fresh = [(17 * r + 3 * j + 2) % 4000 for j in range(4096)]
        await completion(client, ALICE, hers)  # alice's, cached now
        on_hers = await ttft(client, BOB, hers)
        on_fresh = await ttft(client, BOB, fresh)
        ratios.append(on_hers / on_fresh)
    return ratios


def start(root: pathlib.Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    keys = root / "keys"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    argv = [sys.executable, "-m", "hicache.tools.cli", "serve", *MODEL, "--http", "127.0.0.1:0",
            "--api-keys", str(keys), "--admin-api-key", ADMIN, "--l3", f"file://{root}/l3",
            "--l3-allow", f"file://{root}/allowed/", "--rate-limit", "20",
            "--max-body-bytes", "65536", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if " on http://" not in line:
        raise RuntimeError(
            f"the server did not start: {line} {proc.stderr.read() if proc.stderr else ''}"
        )
    return proc, line.rsplit(" ", 1)[1].strip()


async def campaign(url: str, root: pathlib.Path, rounds: int) -> tuple[Tally, float, list[float]]:
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        await refusals(client, tally, root)
        await isolation(client, tally)
        health_s = await slow_headers_and_flood(client, url, tally)
    await dropped_streams(url, tally)
    await asyncio.sleep(1.1)  # bob's bucket refills before the timed rounds
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        ratios = await cross_tenant_ttft(client, rounds)
    return tally, health_s, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ttft-rounds", type=int, default=5)
    parser.add_argument(
        "--control", action="store_true",
        help="only the TTFT rounds, on a server started with --share-cache: the ratio a "
        "shared prefix gives, to show the figure tells the two apart",
    )  # fmt: skip
    args = parser.parse_args()
    if args.control:
        return control(args.ttft_rounds)
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch)
        proc, url = start(root)
        try:
            tally, health_s, ratios = asyncio.run(campaign(url, root, args.ttft_rounds))
            tally.crashes = int(proc.poll() is not None)
        finally:
            proc.terminate()
            _, stderr = proc.communicate(timeout=60)
        tally.secrets_leaked += sum(s in stderr for s in SECRETS)
    print(
        f"requests {tally.tried}, refused with the right status {tally.refused_right} of "
        f"{tally.expected_refusals}, secrets leaked {tally.secrets_leaked}, cross-tenant hits "
        f"{tally.cross_tenant_hits}, crashes {tally.crashes}, /health under load "
        f"{health_s * 1e3:.0f} ms"
    )
    print(json.dumps({"cross_tenant_ttft_ratio": round(statistics.median(ratios), 3),
                      "rounds": [round(r, 3) for r in ratios]}))  # fmt: skip
    for line in tally.wrong:
        print(f"wrong: {line}")
    bad = tally.secrets_leaked or tally.cross_tenant_hits or tally.crashes or tally.wrong
    return 1 if bad else 0


def control(rounds: int) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        proc, url = start(pathlib.Path(scratch), "--share-cache")
        try:

            async def run() -> list[float]:
                async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
                    return await cross_tenant_ttft(client, rounds)

            ratios = asyncio.run(run())
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
    print(json.dumps({"shared_cache_ttft_ratio": round(statistics.median(ratios), 3),
                      "rounds": [round(r, 3) for r in ratios]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
