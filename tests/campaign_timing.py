"""The campaign's timed cases: time to first token across tenants, and a well-behaved
tenant's beside a hostile one holding streams it never reads (tests/campaign_server.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from campaign_cases import (
    ALICE,
    BOB,
    BOB_ADDRESS,
    MAX_CONCURRENT,
    RATE_PER_S,
    V1,
    Tally,
    Target,
    client,
    completion,
    headers,
    settled,
    status_line,
    tls_socket,
)

HOSTILE_STREAMS = 100
PACE_S = 1.25 / RATE_PER_S  # alice stays under her rate limit


async def ttft(c: httpx.AsyncClient, key: str, prompt: list[int]) -> float | None:
    """Seconds to the first event of a streamed request; None if it was refused or empty."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    async with c.stream("POST", V1, json=body, headers=headers(key)) as r:
        async for line in r.aiter_lines():
            if r.status_code == 200 and line.startswith("data: "):
                return time.perf_counter() - started
    return None


async def cross_tenant_ttft(c: httpx.AsyncClient, rounds: int) -> list[float]:
    """Per round: bob's TTFT on alice's cached prompt over his TTFT on a fresh one."""
    ratios = []
    for r in range(rounds):
        hers = [(13 * r + 5 * j + 1) % 4000 for j in range(4096)]
        fresh = [(17 * r + 3 * j + 2) % 4000 for j in range(4096)]
        await completion(c, ALICE, hers)  # alice's, cached now
        on_hers, on_fresh = await ttft(c, BOB, hers), await ttft(c, BOB, fresh)
        if on_hers is None or on_fresh is None:
            raise RuntimeError("bob's timed request was refused")
        ratios.append(on_hers / on_fresh)
    return ratios


# A well-behaved tenant's prompt: a system prompt and a question, as chat clients send.
ALICE_TOKENS = 512


async def alice_ttfts(c: httpx.AsyncClient, tally: Tally, count: int, seed: int) -> list[float]:
    """Alice's streamed requests one after another (fresh prompts of ALICE_TOKENS), under her
    rate."""
    times = []
    for i in range(count):
        started = time.perf_counter()
        prompt = [(seed * 7919 + i * 31 + j * 7) % 4000 for j in range(ALICE_TOKENS)]
        took = await ttft(c, ALICE, prompt)
        tally.check("alice's request beside the hostile tenant", took is not None)
        times += [took] if took is not None else []
        await asyncio.sleep(max(0.0, PACE_S - (time.perf_counter() - started)))
    return times


def hostile_streams(t: Target) -> tuple[list[Any], list[int]]:
    """Bob's streams over TLS, from his own address, with a tiny receive buffer, never read past
    the status line: the sockets (None where closed at once) and the statuses (0: none)."""
    body = f'{{"prompt": {[7] * 16}, "max_tokens": 200, "stream": true}}'.encode()
    head = (
        f"POST {V1} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {BOB}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sockets: list[Any] = []
    for _ in range(HOSTILE_STREAMS):
        try:
            sock = tls_socket(t, BOB_ADDRESS, rcvbuf=1024)
            sock.sendall(head + body)
            sockets.append(sock)
        except OSError:
            sockets.append(None)  # past the connections one client may open
    statuses = []
    for sock in sockets:
        try:
            statuses.append(status_line(sock.recv(12)) if sock is not None else 0)
        except OSError:
            statuses.append(0)
    return sockets, statuses


def count_hostile(tally: Tally, statuses: list[int]) -> None:
    """Past --max-concurrent a 429, past the per-client cap a closed connection: both right."""
    admitted = statuses.count(200)
    refused = sum(s in (0, 429) for s in statuses)
    tally.tried += len(statuses)
    tally.expected_refusals += len(statuses) - admitted
    tally.refused_right += refused
    if admitted > MAX_CONCURRENT or refused != len(statuses) - admitted:
        tally.wrong.append(f"hostile streams: {admitted} admitted, statuses {set(statuses)}")


async def hostile_round(
    t: Target, tally: Tally, alice: httpx.AsyncClient, n: int, seed: int
) -> list[float]:
    """Alice's TTFTs while bob holds his streams open; his outcomes counted."""
    sockets, statuses = await asyncio.to_thread(hostile_streams, t)
    try:
        return await alice_ttfts(alice, tally, n, seed)
    finally:
        for sock in sockets:
            if sock is not None:
                sock.close()
        count_hostile(tally, statuses)
        tally.check("bob's dropped streams end", await settled(t))


async def hostile_ttft(t: Target, tally: Tally, rounds: int, n: int) -> dict[str, Any]:
    """Alice's TTFT alone and beside bob's held streams, in alternating rounds."""
    alone: list[float] = []
    beside: list[float] = []
    async with client(t, timeout=60.0, connections=1) as alice:
        await completion(alice, ALICE, [1])  # her connection, open before bob's flood
        for r in range(rounds):
            for hostile in (r % 2 == 0, r % 2 == 1):
                if hostile:
                    beside += await hostile_round(t, tally, alice, n, 2 * r)
                else:
                    alone += await alice_ttfts(alice, tally, n, 2 * r + 1)
    figures = {f"{name}_{q}_ms": percentile(times, q) for name, times in
               (("alone", alone), ("hostile", beside)) for q in ("p50", "p99")}  # fmt: skip
    for q in ("p50", "p99"):
        figures[f"{q}_ratio"] = round(figures[f"hostile_{q}_ms"] / figures[f"alone_{q}_ms"], 3)
    return figures | {"requests_each": len(alone)}


def percentile(values: list[float], q: str) -> float:
    """The nearest-rank percentile (``p50``, ``p99``) of seconds, in ms."""
    ranked = sorted(values) or [float("nan")]
    rank = max(1, -(-int(q[1:]) * len(ranked) // 100))
    return round(ranked[rank - 1] * 1e3, 1)


# ----- a mode, whole ------------------------------------------------------------------------
