"""The hostile-client campaign against a real ``hicache serve --http`` (issues 35 and 45).

``python tests/campaign_server.py [--modes single,router,remote] [--ttft-rounds N]
[--hostile-rounds R] [--hostile-requests M]`` plays every case in each mode, all over TLS:

- ``single``: one server with two tenant keys (a key file), an admin key (from a file), an L3
  allow-list and request limits;
- ``router``: ``--workers 2 --router round_robin`` (the router holds the keys; its workers
  take its ``--l3=URL`` in their environment);
- ``remote``: two https workers started apart with an internal token, and a router over them
  (``--worker https://... --worker-ca-file``).

The cases (tests/campaign_cases.py and below): plain HTTP to a TLS port; missing, wrong and
non-UTF-8 keys; a tenant key on admin routes and attaches outside the allow-list (single);
oversized, deep, huge-integer and over-long bodies; priorities past a cap; cross-tenant and
cross-salt prompts; large prompts and a flood past the limits while /health is timed (and the
router keeps its workers); streams dropped mid-way; an emptied key file on SIGHUP; connections
that never handshake and more than one client may open; secrets on command lines; a hostile
tenant holding streams it never reads while a well-behaved one's TTFT is measured; tenant keys
sent straight to remote workers, and their loss (a 502, a 503 naming no address).

Per mode it prints a line of counts, then a JSON line of figures: the cross-tenant TTFT ratio
(tenant B's TTFT on tenant A's cached prompt over B's on a fresh one, about 1 when nothing is
shared) and alice's TTFT p50/p99 alone and beside the hostile tenant, alternating rounds. Exits
1 when a secret leaked, a cross-tenant hit happened, a server died, or an outcome was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import re
import secrets
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import httpx
from campaign_cases import (
    ADMIN,
    ALICE,
    BOB,
    HEADER_TIMEOUT_S,
    KEY_FILE_TEXT,
    LIMIT_FLAGS,
    MAX_CONCURRENT,
    MODEL,
    PER_CLIENT,
    RETIRED,
    V1,
    Proc,
    Tally,
    Target,
    address,
    admin_cases,
    allow_flags,
    check_refused_at_start,
    client,
    cmdline_cases,
    completion,
    dependency_floors,
    headers,
    isolation,
    json_line,
    key_reload,
    metric_sum,
    metrics,
    refusals,
    refused_at_start,
    router_health,
    settled,
    straight_to_workers,
    tls_cases,
)
from campaign_timing import cross_tenant_ttft, hostile_ttft
from tls_kit import self_signed

MODES = ("single", "router", "remote")
UNHANDLED = r"Traceback \(most recent call last\)"  # one per error a handler raised


def serve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "hicache.tools.cli", "serve", *MODEL, "--http", "127.0.0.1:0",
            *args]  # fmt: skip


def secret_file(path: pathlib.Path, text: str, mode: int = 0o600) -> pathlib.Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def start_single(root: pathlib.Path, tls: Any, *extra: str) -> Target:
    keys = secret_file(root / "keys", KEY_FILE_TEXT)
    admin = secret_file(root / "admin-key", ADMIN + "\n")
    proc = Proc("the server", serve_argv(
        "--ssl-certfile", tls.certfile, "--ssl-keyfile", tls.keyfile, "--api-keys", str(keys),
        "--admin-api-key-file", str(admin), "--l3", f"file://{root}/l3", *allow_flags(root),
        *LIMIT_FLAGS, *extra))  # fmt: skip
    url = proc.wait_url()
    ctx = ssl.create_default_context(cafile=tls.certfile)
    return Target("single", url, ctx, root, keys, proc, [proc], forbidden=[ALICE, BOB, ADMIN])


def start_router(root: pathlib.Path, tls: Any) -> Target:
    """The router starts its workers; the key file is readable by others here (warned about).
    The L3 URL is the router's ``--l3=URL``: its workers take it in their environment, never
    on their command lines."""
    keys = secret_file(root / "keys", KEY_FILE_TEXT, 0o644)
    l3 = f"file://{root}/l3-store"
    proc = Proc("the router", serve_argv(
        "--workers", "2", "--router", "round_robin", "--ssl-certfile", tls.certfile,
        "--ssl-keyfile", tls.keyfile, "--api-keys", str(keys), f"--l3={l3}",
        *LIMIT_FLAGS))  # fmt: skip
    url = proc.wait_url()
    ctx = ssl.create_default_context(cafile=tls.certfile)
    return Target("router", url, ctx, root, keys, proc, [proc], forbidden=[ALICE, BOB],
                  worker_forbidden=[l3, "l3-store"])  # fmt: skip


def start_remote(root: pathlib.Path, tls: Any) -> Target:
    token = secrets.token_urlsafe(32)
    token_file = secret_file(root / "internal-token", token)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two engines share the cores
    workers = [Proc(f"worker {i}", serve_argv(
        "--internal-token-file", str(token_file), "--ssl-certfile", tls.certfile,
        "--ssl-keyfile", tls.keyfile, "--l3", f"file://{root}/l3", "--header-timeout", "2",
        "--write-timeout", "2", "--max-body-bytes", "65536"), env) for i in range(2)]  # fmt: skip
    urls = [w.wait_url() for w in workers]
    keys = secret_file(root / "keys", KEY_FILE_TEXT)
    router = Proc("the router", serve_argv(
        "--worker", urls[0], "--worker", urls[1], "--worker-ca-file", tls.certfile,
        "--internal-token-file", str(token_file), "--ssl-certfile", tls.certfile,
        "--ssl-keyfile", tls.keyfile, "--api-keys", str(keys), "--router", "round_robin",
        *LIMIT_FLAGS))  # fmt: skip
    url = router.wait_url()
    ctx = ssl.create_default_context(cafile=tls.certfile)
    return Target("remote", url, ctx, root, keys, router, [router, *workers], workers,
                  forbidden=[ALICE, BOB, token], token=token)  # fmt: skip


START: dict[str, Callable[[pathlib.Path, Any], Target]] = {
    "single": start_single, "router": start_router, "remote": start_remote,
}  # fmt: skip


# ----- load ---------------------------------------------------------------------------------
async def health_times(c: httpx.AsyncClient, stop: asyncio.Event) -> tuple[float, set[int]]:
    """/health asked every 50 ms until ``stop``: the worst time it took, and its statuses."""
    worst, statuses = 0.0, set()
    while not stop.is_set():
        started = time.perf_counter()
        statuses.add((await c.get("/health")).status_code)
        worst = max(worst, time.perf_counter() - started)
        await asyncio.sleep(0.05)
    return worst, statuses


async def in_fours(alice: httpx.AsyncClient, texts: list[str]) -> list[httpx.Response]:
    """Alice's completions of ``texts``, MAX_CONCURRENT at a time (her limit)."""
    answers: list[httpx.Response] = []
    for at in range(0, len(texts), MAX_CONCURRENT):
        group = texts[at : at + MAX_CONCURRENT]
        answers += await asyncio.gather(*(completion(alice, ALICE, text) for text in group))
    return answers


async def load_cases(t: Target, tally: Tally) -> float:
    """Alice posts large text prompts (over the context: a 400 each; and within it: slow
    replies) while bob floods past his limits; /health is timed meanwhile, and a router keeps
    both workers. The worst /health time, in seconds."""
    retired = t.keeper.count(RETIRED)
    async with client(t) as alice, client(t) as bob, client(t, connections=1) as prober:
        stop = asyncio.Event()
        probe = asyncio.create_task(health_times(prober, stop))
        texts = ["x" * 60_000] * 4 + ["".join(chr(97 + (i * k) % 26) for i in range(2000))
                                      for k in range(3, 7)]  # fmt: skip
        flood = asyncio.gather(*(completion(bob, BOB, [5, 6, 7]) for _ in range(100)))
        large_answers, answers = await asyncio.gather(in_fours(alice, texts), flood)
        stop.set()
        worst, statuses = await probe
        honest = await completion(alice, ALICE, [9, 9, 9])
        for i, answer in enumerate(large_answers):
            if i < 4:
                tally.refusal("a 60 KB text prompt, under load", answer, 400)
            else:
                tally.check("a long prompt within the context", answer.status_code == 200,
                            str(answer.status_code))  # fmt: skip
        flood_outcome(tally, answers)
        tally.check("/health and an honest request under load", statuses == {200}
                    and honest.status_code == 200, f"{statuses}, {honest.status_code}")  # fmt: skip
        if t.cluster:
            body = (await alice.get("/health", headers=headers(ALICE))).json()
            alive = [w["alive"] for w in body.get("workers", [])]
            kept = alive == [True, True] and t.keeper.count(RETIRED) == retired
            tally.check("the router kept every worker through the load", kept, str(body))
    return worst


def flood_outcome(tally: Tally, answers: list[httpx.Response]) -> None:
    limited = sum(a.status_code == 429 for a in answers)
    tally.tried += len(answers)
    if limited == 0 or any(a.status_code not in (200, 429) for a in answers):
        tally.wrong.append(f"flood: {limited} of {len(answers)} got a 429")
    tally.expected_refusals += limited
    tally.refused_right += limited


async def dropped_streams(t: Target, tally: Tally) -> None:
    for _ in range(5):
        async with client(t, timeout=30.0) as c:
            body = {"prompt": [3, 4, 5], "max_tokens": 200, "stream": True}
            async with c.stream("POST", V1, json=body, headers=headers(ALICE)) as response:
                async for _ in response.aiter_lines():
                    break  # one line, then hang up
        tally.tried += 1
    tally.check("dropped streams end", await settled(t))


# ----- connections --------------------------------------------------------------------------
async def closed_now(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.02) == b""
    except TimeoutError:  # first: a TimeoutError is an OSError too
        return False
    except OSError:
        return True


async def connection_cases(t: Target, tally: Tally, count: int = PER_CLIENT + 6) -> None:
    """Connections that never start their TLS handshake: those past --max-connections-per-client
    closed at once, the others counted and closed after --header-timeout."""
    prefix = t.metric_prefix + "_http_connections"
    before = await metrics(t)
    host, port = address(t.url)
    opened = [await asyncio.open_connection(host, port) for _ in range(count)]
    await asyncio.sleep(0.5)
    at_once = sum([await closed_now(reader) for reader, _ in opened])
    await asyncio.sleep(HEADER_TIMEOUT_S)
    deadline = time.monotonic() + 3.0
    while not all([await closed_now(r) for r, _ in opened]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    left = sum([not await closed_now(reader) for reader, _ in opened])
    for _, writer in opened:
        writer.close()
    after = await metrics(t)

    def grew(name: str) -> float:
        total = f"{prefix}_{name}_total"
        return metric_sum(after, total) - metric_sum(before, total)

    tally.refused(f"connections past {PER_CLIENT} from one client", at_once >= count - PER_CLIENT
                  and grew("refused") >= at_once, f"{at_once} closed at once")  # fmt: skip
    tally.refused("connections with no handshake, after the header timeout", left == 0
                  and grew("timed_out") >= count - at_once, f"{left} left open")  # fmt: skip
    async with client(t) as c:
        tally.check("/health after the connections", (await c.get("/health")).status_code == 200)


# ----- time to first token ------------------------------------------------------------------
async def campaign(t: Target, tally: Tally, args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"mode": t.mode}
    await tls_cases(t, tally)
    async with client(t) as c:
        await refusals(c, tally, figures)
        await admin_cases(c, t, tally)
        if t.cluster:
            await router_health(c, tally)
        await isolation(c, tally)
    if t.workers:
        await straight_to_workers(t, tally)
    figures["health_under_load_ms"] = round(await load_cases(t, tally) * 1e3, 1)
    await dropped_streams(t, tally)
    await key_reload(t, tally)
    await connection_cases(t, tally)
    await asyncio.sleep(1.0)  # bob's bucket refills
    figures["ttft"] = await hostile_ttft(t, tally, args.hostile_rounds, args.hostile_requests)
    async with client(t, timeout=120.0) as c:
        ratios = await cross_tenant_ttft(c, args.ttft_rounds)
    figures["cross_tenant_ttft_ratio"] = round(statistics.median(ratios), 3)
    figures["rounds"] = [round(r, 3) for r in ratios]
    if t.workers:
        await worker_loss(t, tally)
    return figures


async def worker_loss(t: Target, tally: Tally) -> None:
    """Remote mode, last: a worker killed under a request is a 502, no worker left a 503;
    neither answer names an internal address."""
    async with client(t) as c:
        for _ in range(2):  # round robin: after worker 0 answers, worker 1 takes the next
            if (await completion(c, ALICE, [1, 2])).headers.get("X-Hicache-Worker") == "0":
                break
        long = asyncio.create_task(completion(c, ALICE, [3, 4, 5], max_tokens=2000))
        await asyncio.sleep(0.5)
        t.workers[1].kill()
        tally.refusal("a request on a worker that died", await long, 502)
        t.workers[0].kill()
        tally.refusal("a request with every worker gone", await completion(c, ALICE, [1]), 503)


def worker_pids(t: Target) -> dict[str, int]:
    """The router's workers, from its log (``worker N at URL (pid P)``), or those started."""
    if t.workers:
        return {w.name: w.pid for w in t.workers}
    found = {}
    for line in t.keeper.lines:
        if line.startswith("worker ") and "(pid " in line:
            found[line.split(" at ")[0]] = int(line.rsplit("(pid ", 1)[1].rstrip(")\n"))
    return found


def before_the_run(t: Target, tally: Tally) -> None:
    """No secret on a command line (the router's workers found in its log)."""
    if t.token is not None:
        tally.hidden.append(t.token)  # never in an answer or a log either
    pids = {p.name: p.pid for p in t.procs} | (worker_pids(t) if t.cluster else {})
    tally.check("the router logged its workers", not t.cluster or len(pids) == 3, str(pids))
    cmdline_cases(t, tally, pids)


def after_the_run(t: Target, tally: Tally) -> None:
    """What the processes show: the key-file warning, crashes, exit statuses, logs."""
    warned = t.keeper.count("readable by other users") > 0
    tally.check("a key file others may read is warned about (only then)",
                warned == (t.mode == "router"))  # fmt: skip
    tally.crashes += sum(p.popen.poll() is not None and not p.killed for p in t.procs)
    tally.crashes += t.keeper.count(r"worker \d+ exited")
    for proc in t.procs:
        code = proc.stop()
        if not proc.killed and code != 0:
            tally.wrong.append(f"{proc.name} exited {code} after SIGTERM")
        tally.leaks(proc.stderr)
        unhandled = proc.count(UNHANDLED)  # a handler raised: aiohttp answered a 500
        tally.check(f"no unhandled error in {proc.name}'s log", unhandled == 0, f"{unhandled}")


def log_excerpt(proc: Proc, most: int = 8) -> list[str]:
    """The error lines of a process's log (each once), to show with a wrong outcome."""
    lines = [line.rstrip() for line in proc.lines if re.search(r"ERROR|Error\b|error:", line)]
    return list(dict.fromkeys(lines))[-most:]


def play(mode: str, args: argparse.Namespace, first: bool) -> tuple[Tally, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch)
        launched = refused_at_start() if first else []
        target = START[mode](root, self_signed(root))
        tally = Tally()
        try:
            before_the_run(target, tally)
            figures = asyncio.run(campaign(target, tally, args))
            after_the_run(target, tally)
            if tally.wrong:
                for proc in target.procs:
                    tally.log += [f"{proc.name}: {line}" for line in log_excerpt(proc)]
        finally:
            for proc in target.procs:
                if proc.popen.poll() is None:
                    proc.popen.kill()
        if first:
            check_refused_at_start(launched, tally)
            dependency_floors(tally)
    return tally, figures


def report(mode: str, tally: Tally, figures: dict[str, Any]) -> None:
    print(
        f"[{mode}] requests {tally.tried}, refused with the right status {tally.refused_right} "
        f"of {tally.expected_refusals}, secrets leaked {tally.secrets_leaked}, cross-tenant "
        f"hits {tally.cross_tenant_hits}, crashes {tally.crashes}, /health under load "
        f"{figures['health_under_load_ms']:.0f} ms", flush=True,
    )  # fmt: skip
    print(json_line(figures), flush=True)
    for line in tally.wrong:
        print(f"[{mode}] wrong: {line}", flush=True)
    for line in tally.log:
        print(f"[{mode}] log of {line}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", default=",".join(MODES), help="of single, router, remote")
    parser.add_argument("--ttft-rounds", type=int, default=5)
    parser.add_argument("--hostile-rounds", type=int, default=4)
    parser.add_argument("--hostile-requests", type=int, default=20, help="alice's, per round")
    parser.add_argument(
        "--control", action="store_true",
        help="only the TTFT rounds, on a server started with --share-cache: the ratio a "
        "shared prefix gives, to show the figure tells the two apart",
    )  # fmt: skip
    args = parser.parse_args()
    if args.control:
        return control(args.ttft_rounds)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes some of {', '.join(MODES)}")
    bad = False
    for i, mode in enumerate(modes):
        tally, figures = play(mode, args, first=i == 0)
        report(mode, tally, figures)
        bad |= bool(tally.secrets_leaked or tally.cross_tenant_hits or tally.crashes or tally.wrong)
    return 1 if bad else 0


def control(rounds: int) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch)
        target = start_single(root, self_signed(root), "--share-cache")
        try:

            async def run() -> list[float]:
                async with client(target, timeout=120.0) as c:
                    return await cross_tenant_ttft(c, rounds)

            ratios = asyncio.run(run())
        finally:
            target.keeper.stop()
    print(json_line({"shared_cache_ttft_ratio": round(statistics.median(ratios), 3),
                     "rounds": [round(r, 3) for r in ratios]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
