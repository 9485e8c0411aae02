"""``hicache bench cluster``: several workers behind each router, over HTTP, on a multi-tenant
shared-prefix workload; and the cost of HTTP itself against the same engine in process.

Each run starts ``hicache serve --http 127.0.0.1:0 --workers N --router R`` with an empty L3
directory of its own, sends the workload from ``--concurrency`` clients (aiohttp, streaming, so
TTFT is the first token's arrival at the client), reads every answer's cached tokens per tier
and which worker served it (``X-Hicache-Worker``), and stops the server. ``hit_rate`` is what the
serving worker's own device and host held (what routing decides); ``l3_hit_rate`` what the
shared L3 added. ``throughput_tok_s`` counts prompt and generated tokens. A tenant's prefix is
first computed where its first request ran; an L3 hit of a later request of that tenant on
another worker is a cross-worker hit. The baseline run serves the same workload from one engine
in this process (no HTTP); the ``workers: 1`` HTTP run is compared with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hicache.tools.cli_parsing import int_range

__all__ = ["add_bench_cluster_parser", "run_bench_cluster"]

_SERVE = ("--hidden 256 --layers 2 --heads 4 --kv-heads 2 --head-dim 64 --vocab 4096 "
          "--device-tokens 2048 --max-running 4")  # fmt: skip


def add_bench_cluster_parser(bench_sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "cluster", help="workers behind cache-aware and round-robin routers, over HTTP"
    )
    p.add_argument("--workers", type=int_range(1, 16), action="append",
                   help="worker counts to run (default 2 and 4)")  # fmt: skip
    p.add_argument("--router", choices=["cache_aware", "round_robin"], action="append",
                   help="routers to run (default both)")  # fmt: skip
    # 32 tenants' prefixes fill a worker's device and host about 3 times over: one worker holds
    # a quarter of them, which is what a cache-aware router over 4 workers asks of it.
    p.add_argument("--tenants", type=int_range(1, 1024), default=32)
    p.add_argument("--requests", type=int_range(1, 100_000), default=192)
    p.add_argument("--prefix-tokens", type=int_range(16, 1 << 16), default=512)
    p.add_argument("--suffix-tokens", type=int_range(1, 1 << 16), default=32)
    p.add_argument("--output-tokens", type=int_range(1, 1 << 12), default=4)
    p.add_argument("--concurrency", type=int_range(1, 1024), default=8)
    p.add_argument("--seed", type=int_range(0, 1 << 31), default=0)
    p.add_argument("--serve-args", default=_SERVE,
                   help=f"flags for every `hicache serve` (default: {_SERVE})")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=run_bench_cluster)
    return p


@dataclass(frozen=True, slots=True)
class _Workload:
    prompts: list[tuple[int, list[int]]]  # (tenant, prompt)
    output_tokens: int
    concurrency: int


@dataclass(slots=True)
class _Answer:
    tenant: int
    worker: int
    ttft_s: float
    prompt_tokens: int
    tiers: dict[str, int]
    generated: int


def run_bench_cluster(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    work = _workload(args)
    serve_args = shlex.split(args.serve_args)
    baseline = _row("in_process", 1, asyncio.run(_in_process(work, serve_args)))
    yield baseline
    http_one = _row("http", 1, _over_http(work, serve_args, 1, "round_robin"))
    yield http_one
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for workers in args.workers or [2, 4]:
        for router in args.router or ["cache_aware", "round_robin"]:
            rows[(workers, router)] = _row(
                router, workers, _over_http(work, serve_args, workers, router)
            )
            yield rows[(workers, router)]
    yield _summary(baseline, http_one, rows)


def _workload(args: argparse.Namespace) -> _Workload:
    rng = random.Random(args.seed)
    vocab = 4000  # within the default model's vocabulary
    prefixes = [
        [rng.randrange(vocab) for _ in range(args.prefix_tokens)] for _ in range(args.tenants)
    ]
    prompts = []
    for _ in range(args.requests):
        tenant = rng.randrange(args.tenants)
        suffix = [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
        prompts.append((tenant, prefixes[tenant] + suffix))
    return _Workload(prompts, args.output_tokens, args.concurrency)


# ----- the clients ----------------------------------------------------------------------------
async def _clients(work: _Workload, one: Any) -> tuple[list[_Answer], float]:
    """Send the workload from ``work.concurrency`` clients, each taking the next prompt when
    its last answer is complete; (answers in completion order, wall seconds). First, untimed,
    one request per client of a prompt no tenant shares: every worker and thread has run once."""
    await asyncio.gather(*(one(-1, [1 + i] * 64) for i in range(work.concurrency)))
    pending = list(reversed(work.prompts))
    answers: list[_Answer] = []

    async def client() -> None:
        while pending:
            tenant, prompt = pending.pop()
            answers.append(await one(tenant, prompt))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(work.concurrency)))
    return answers, time.perf_counter() - started


async def _drive_http(url: str, work: _Workload) -> tuple[list[_Answer], float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(tenant: int, prompt: list[int]) -> _Answer:
            body = {"prompt": prompt, "max_tokens": work.output_tokens, "temperature": 0,
                    "stream": True}  # fmt: skip
            started, ttft, usage = time.perf_counter(), None, None
            async with session.post(f"{url}/v1/completions", json=body) as answer:
                if answer.status != 200:
                    raise RuntimeError(f"HTTP {answer.status}: {await answer.text()}")
                worker = int(answer.headers.get("X-Hicache-Worker", "0"))
                async for raw in answer.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    if ttft is None and chunk["choices"][0]["token_ids"]:
                        ttft = time.perf_counter() - started
                    usage = chunk.get("usage", usage)
            assert ttft is not None and usage is not None
            return _answer(tenant, worker, ttft, usage)

        return await _clients(work, one)


def _answer(tenant: int, worker: int, ttft: float, usage: dict[str, Any]) -> _Answer:
    details = usage["prompt_tokens_details"]
    tiers = {tier: int(details[tier]) for tier in ("device", "host", "l3")}
    return _Answer(tenant, worker, ttft, usage["prompt_tokens"], tiers, usage["completion_tokens"])


def _over_http(
    work: _Workload, serve_args: list[str], workers: int, router: str
) -> tuple[list[_Answer], float]:
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryFile("w+") as log:
        argv = [sys.executable, "-m", "hicache.tools.cli", "serve", *serve_args, "--http",
                "127.0.0.1:0", "--workers", str(workers), "--router", router, "--cache-dir",
                cache]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if " on http://" not in line:
                proc.wait(timeout=60)
                log.seek(0)
                raise RuntimeError(f"serve did not start: {log.read()[-2000:]}")
            return asyncio.run(_drive_http(line.rsplit(" ", 1)[1].strip(), work))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


async def _in_process(work: _Workload, serve_args: list[str]) -> tuple[list[_Answer], float]:
    """The same workload submitted straight to one engine's online source (no HTTP)."""
    from hicache.models.tiny import TinyTransformer
    from hicache.serving.online import OnlineSource
    from hicache.serving.setup import open_engine
    from hicache.tools.cli import build_parser
    from hicache.tools.serve.config import (
        checked_model,
        engine_config_of,
        hicache_config,
        hisparse_config,
    )
    from hicache.tools.serve.http import serving_mode

    with tempfile.TemporaryDirectory() as cache:
        argv = ["serve", *serve_args, "--cache-dir", cache]
        args = build_parser(argv).parse_args(argv)
        hicache = hicache_config(args)
        config, plan, device = checked_model(args, hicache)
        model = plan.load() if plan else TinyTransformer(config, device)
        engine_config = engine_config_of(args, hisparse_config(args))
        setup = await open_engine(model, serving_mode(hicache), hicache, args.device_tokens,
                                  engine_config)  # fmt: skip
        source = OnlineSource(setup.engine.now)
        running = asyncio.create_task(setup.engine.run(source, wake=source.wake))

        async def one(tenant: int, prompt: list[int]) -> _Answer:
            started = time.perf_counter()
            admission = source.submit(prompt, work.output_tokens, 0.0)
            await admission.tokens.get()
            ttft = time.perf_counter() - started
            while await admission.tokens.get() is not None:
                pass
            record = (await admission.done).record
            tiers = {"device": record.hit_device, "host": record.hit_host, "l3": record.hit_l3}
            return _Answer(tenant, 0, ttft, len(prompt), tiers, record.output_tokens)

        try:
            return await _clients(work, one)
        finally:
            source.close()
            with contextlib.suppress(Exception):
                await running
            await setup.close()


# ----- rows -----------------------------------------------------------------------------------
def _row(router: str, workers: int, run: tuple[list[_Answer], float]) -> dict[str, Any]:
    answers, wall = run
    prompt = sum(a.prompt_tokens for a in answers)
    local = sum(a.tiers["device"] + a.tiers["host"] for a in answers)
    l3 = sum(a.tiers["l3"] for a in answers)
    origin: dict[int, int] = {}
    cross = 0
    for a in answers:  # completion order: a tenant's prefix came from its first answer's worker
        first = origin.setdefault(a.tenant, a.worker)
        cross += a.tiers["l3"] if a.worker != first else 0
    ttfts = sorted(a.ttft_s for a in answers)
    tokens = prompt + sum(a.generated for a in answers)
    return {
        "workers": workers,
        "router": router,
        "requests": len(answers),
        "hit_rate": round(local / prompt, 4) if prompt else 0.0,
        "l3_hit_rate": round(l3 / prompt, 4) if prompt else 0.0,
        "l3_hit_tokens": l3,
        "l3_cross_worker_hit_tokens": cross,
        "ttft_mean_ms": round(1000 * sum(ttfts) / len(ttfts), 2),
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 2),
        "throughput_tok_s": round(tokens / wall, 1),
        "wall_s": round(wall, 2),
    }


def _summary(
    baseline: dict[str, Any], http_one: dict[str, Any], rows: dict[tuple[int, str], dict[str, Any]]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "summary": True,
        "http_ttft_overhead": round(http_one["ttft_mean_ms"] / baseline["ttft_mean_ms"] - 1, 4),
    }
    for (workers, router), row in rows.items():
        other = rows.get((workers, "round_robin"))
        if router == "cache_aware" and other is not None and other["hit_rate"] > 0:
            out[f"hit_rate_ratio_{workers}w"] = round(row["hit_rate"] / other["hit_rate"], 3)
            out[f"cache_aware_ttft_lower_{workers}w"] = row["ttft_mean_ms"] < other["ttft_mean_ms"]
        if router == "round_robin":
            out[f"round_robin_l3_cross_worker_hit_tokens_{workers}w"] = row[
                "l3_cross_worker_hit_tokens"
            ]
    return out
