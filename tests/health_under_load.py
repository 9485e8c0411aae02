"""/health latency of a `hicache serve --http` while clients post ~16 MiB prompts.

python tests/health_under_load.py [--kind text|ids|chat] [--seconds 20] [--clients 4]
Run from the repository root with its venv's python.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time

MODEL = [
    "--hidden",
    "256",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--vocab",
    "4096",
    "--device-tokens",
    "16384",
]
BODY_LIMIT = 16 << 20


def body(kind: str) -> bytes:
    room = BODY_LIMIT - 200
    if kind == "text":
        return json.dumps({"prompt": "a" * room, "max_tokens": 1}).encode()
    if kind == "ids":
        return json.dumps({"prompt": [7] * (room // 3), "max_tokens": 1}).encode()
    messages = [{"role": "user", "content": "a" * room}]
    return json.dumps({"messages": messages, "max_tokens": 1}).encode()


def poster(port: int, kind: str, stop_at: float, counts: mp.Queue) -> None:
    data = body(kind)
    sent, statuses = 0, {}
    while time.time() < stop_at:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request(
            "POST",
            "/v1/completions" if kind != "chat" else "/v1/chat/completions",
            body=data,
            headers={"Content-Type": "application/json"},
        )
        answer = conn.getresponse()
        answer.read()
        statuses[answer.status] = statuses.get(answer.status, 0) + 1
        sent += 1
        conn.close()
    counts.put((sent, statuses))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="text", choices=["text", "ids", "chat"])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    argv = [sys.executable, "-m", "hicache.tools.cli", "serve", *MODEL, "--http", "127.0.0.1:0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on http://" not in line:
        print(line, proc.stderr.read())
        return 1
    port = int(line.rsplit(":", 1)[1].strip().strip("/"))
    try:
        idle = probe(port, time.time() + 2.0)
        stop_at = time.time() + args.seconds
        counts: mp.Queue = mp.Queue()
        posters = [
            mp.Process(target=poster, args=(port, args.kind, stop_at, counts))
            for _ in range(args.clients)
        ]
        for p in posters:
            p.start()
        time.sleep(0.5)
        loaded = probe(port, stop_at)
        for p in posters:
            p.join()
        results = [counts.get() for _ in posters]
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    report("idle", idle)
    report(f"{args.clients} clients posting 16 MiB {args.kind} prompts", loaded)
    print("posts:", sum(r[0] for r in results), "statuses:", [r[1] for r in results])
    return 0


def probe(port: int, until: float) -> list[float]:
    latencies = []
    while time.time() < until:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        start = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        latencies.append(time.perf_counter() - start)
        conn.close()
        time.sleep(0.02)
    return latencies


def report(what: str, latencies: list[float]) -> None:
    ms = sorted(x * 1e3 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    print(
        f"{what}: /health n={len(ms)} p50={statistics.median(ms):.1f} ms "
        f"p99={p99:.1f} ms max={ms[-1]:.1f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
