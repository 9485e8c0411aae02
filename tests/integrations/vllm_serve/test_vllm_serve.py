"""hicache under a running `vllm serve` (vLLM's CPU build), through HiCacheOffloadingSpec.

Every test starts real vLLM OpenAI servers on 127.0.0.1 over a tiny random Llama, talks to them
with the official openai client, and compares greedy outputs with a vLLM started without the
connector. A start costs about 45-70 s on a 2-core machine, so each test does one scenario with
as few starts as it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.tools.bench.engines.vllm_process import (
    Completion,
    ServerOptions,
    VllmServer,
    complete,
    kv_bytes_per_token,
    running,
    spec_config,
    tokens,
)

# Three shared prefixes of 1,024-2,048 tokens, two questions after each.
PREFIXES = [tokens(100 + i, n) for i, n in enumerate((1024, 1536, 2048))]
PROMPTS = [
    prefix + tokens(200 + 10 * i + j, 72) for i, prefix in enumerate(PREFIXES) for j in (0, 1)
]
PREFIX_OF = [len(prefix) for prefix in PREFIXES for _ in (0, 1)]

# A multi-turn trace: six conversations over one system prompt, four turns each, interleaved so
# that each conversation's history is evicted from a small vLLM KV cache between its turns.
SYSTEM = tokens(300, 256)
CONVERSATIONS, TURNS, USER_TOKENS = 6, 4, 160
SMALL_KV_BLOCKS = 64  # vLLM's own cache: 2,048 tokens, a quarter of the trace's working set


def run_prompts(server: VllmServer) -> list[Completion]:
    return [complete(server, prompt) for prompt in PROMPTS]


def run_trace(server: VllmServer) -> list[Completion]:
    """The multi-turn trace; each turn's prompt is the conversation so far."""
    history = [list(SYSTEM) for _ in range(CONVERSATIONS)]
    replies = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            history[c] += tokens(1000 + 10 * c + turn, USER_TOKENS)
            reply = complete(server, history[c], max_tokens=16)
            replies.append(reply)
            history[c] += [int(word) for word in re.findall(r"w(\d+)", reply.text)]
    return replies


def texts(completions: list[Completion]) -> list[str]:
    return [c.text for c in completions]


def tier_hits(server: VllmServer) -> dict[str, float]:
    """Chunk hits per offloading tier, from vLLM's /metrics."""
    hits = {}
    for name, value in server.metrics().items():
        if name.startswith("vllm:kv_offload_tiering_chunk_hits_total{"):
            tier = re.search(r'tier="([^"]+)"', name)
            if tier:
                hits[tier.group(1)] = value
    return hits


@pytest.fixture(scope="module")
def baseline(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Greedy outputs of a vLLM started without the connector."""
    log = tmp_path_factory.mktemp("baseline") / "vllm.log"
    with running(ServerOptions(checkpoint), log) as server:
        return {"prompts": texts(run_prompts(server)), "trace": texts(run_trace(server))}


@pytest.mark.slow  # over 60 s: vLLM started three times
def test_warm_after_a_restart_and_in_a_second_process(
    checkpoint: Path, baseline: dict[str, list[str]], tmp_path: Path
) -> None:
    config = spec_config(f"disk://{tmp_path / 'store'}")
    # The first vLLM as `vllm serve` runs by default: API server, engine and worker processes.
    with running(ServerOptions(checkpoint, config, one_process=False), tmp_path / "a.log") as a:
        cold = run_prompts(a)
        with running(ServerOptions(checkpoint, config), tmp_path / "b.log") as b:
            second = run_prompts(b)  # a second vLLM on the same store, the first still running
    with running(ServerOptions(checkpoint, config), tmp_path / "restart.log") as restarted:
        warm = run_prompts(restarted)
        hits = tier_hits(restarted)

    assert texts(cold) == baseline["prompts"]
    assert texts(second) == baseline["prompts"]
    assert texts(warm) == baseline["prompts"]
    assert cold[0].cached_tokens == 0
    for run in (second, warm):
        for reply, shared in zip(run, PREFIX_OF, strict=True):
            assert reply.cached_tokens >= 0.9 * shared, (run, PREFIX_OF)
    assert hits.get("1:HiCacheTier", 0) >= sum(PREFIX_OF[::2]) // 32 * 0.9


@pytest.mark.slow  # a whole subprocess end to end: out of `-m "not slow"`
def test_pressure_hits_prefixes_vllm_evicted_from_host_and_store(
    checkpoint: Path, baseline: dict[str, list[str]], tmp_path: Path
) -> None:
    # vLLM's cache holds 2,048 tokens, the host tier 64 chunks (2,048 tokens), the trace ~9k.
    chunk_bytes = 32 * kv_bytes_per_token(checkpoint)
    config = spec_config(f"disk://{tmp_path / 'store'}", cpu_bytes=64 * chunk_bytes)
    options = ServerOptions(
        checkpoint, config, max_model_len=SMALL_KV_BLOCKS * 32, gpu_blocks=SMALL_KV_BLOCKS + 1
    )
    with running(options, tmp_path / "vllm.log") as server:
        replies = run_trace(server)
        hits = tier_hits(server)
    assert texts(replies) == baseline["trace"]
    assert hits.get("0:primary", 0) > 0, hits
    assert hits.get("1:HiCacheTier", 0) > 0, hits
    later_turns = replies[CONVERSATIONS:]
    assert all(r.cached_tokens >= len(SYSTEM) for r in later_turns), [
        r.cached_tokens for r in later_turns
    ]


def _fire(server: VllmServer, prompts: list[list[int]]) -> list[threading.Thread]:
    """Send prompts at once from threads; their errors (the server killed) are expected."""

    def send(prompt: list[int]) -> None:
        with contextlib.suppress(Exception):  # the server is killed under it
            complete(server, prompt)

    threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    return threads


def _stored_objects(store: Path) -> int:
    from hicache.backends.registry import open_backend

    async def count() -> int:
        backend = await open_backend(f"disk://{store}?read_only=true")
        try:
            return len([info async for info in backend.scan("")])
        finally:
            await backend.close()

    return asyncio.run(count())


def _corrupt_every_other_page(store: Path) -> list[str]:
    """Flip the last payload byte of every second stored page (as another tool would)."""
    from hicache.backends.registry import open_backend

    async def corrupt() -> list[str]:
        backend = await open_backend(f"disk://{store}")
        try:
            keys = sorted([info.key async for info in backend.scan("")])[::2]
            pages = await backend.get(keys)
            bad = []
            for key, page in zip(keys, pages, strict=True):
                assert page is not None
                damaged = bytearray(page)
                damaged[-1] ^= 0xFF
                bad.append(key)
                assert (await backend.put([key], [bytes(damaged)])) == [True]
            return bad
        finally:
            await backend.close()

    return asyncio.run(corrupt())


def _verify(store: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache.tools.cli", "verify", "--json", "-q", f"disk://{store}"],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # over 60 s: vLLM started twice, the store verified twice
def test_a_killed_vllm_and_corrupt_pages_change_no_output(
    checkpoint: Path, baseline: dict[str, list[str]], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    config = spec_config(f"disk://{store}?segment_bytes=1M")
    server = VllmServer(ServerOptions(checkpoint, config), tmp_path / "killed.log")
    threads: list[threading.Thread] = []
    try:
        server.wait_ready()
        complete(server, PROMPTS[0])
        first_chunks = len(PROMPTS[0]) // 32
        deadline = time.monotonic() + 120
        while _stored_objects(store) < first_chunks and time.monotonic() < deadline:
            time.sleep(0.05)
        stored = _stored_objects(store)
        threads = _fire(server, PROMPTS[1:])
        while _stored_objects(store) == stored and time.monotonic() < deadline:
            time.sleep(0.02)  # kill -9 while the next prompts' chunks are being stored
    finally:
        server.stop(kill=True)
    for thread in threads:
        thread.join(60)
    assert stored == first_chunks
    checked = _verify(store)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["bad"] == []

    corrupted = _corrupt_every_other_page(store)
    with running(ServerOptions(checkpoint, config), tmp_path / "restart.log") as restarted:
        warm = run_prompts(restarted)
        failed_loads = restarted.metrics()
    assert texts(warm) == baseline["prompts"]
    # The damaged pages the restarted vLLM asked for failed their loads (their checksums),
    # never reached the model (the outputs above), and were dropped and stored anew when vLLM
    # recomputed them: what the store holds now checks out, but for damaged pages never read.
    assert any(
        k.startswith("vllm:kv_offload_tiering_promotion_job_failures") and v > 0
        for k, v in failed_loads.items()
    ), "no damaged page was read"
    bad = {entry["key"] for entry in json.loads(_verify(store).stdout)["bad"]}
    assert bad < set(corrupted)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs, unmounted after the test (mounting needs root, as CI has)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_store_fails_jobs_never_requests(
    checkpoint: Path, baseline: dict[str, list[str]], tiny_tmpfs: Path, tmp_path: Path
) -> None:
    config = spec_config(f"disk://{tiny_tmpfs / 'store'}?segment_bytes=1M")
    with running(ServerOptions(checkpoint, config), tmp_path / "vllm.log") as server:
        filler = tiny_tmpfs / "filler"
        with open(filler, "wb") as out:  # fill what the store left free
            try:
                while True:
                    out.write(b"\0" * (1 << 20))
                    out.flush()
            except OSError:
                pass
        replies = run_prompts(server)
        replies_again = run_prompts(server)
        alive = server.process.poll() is None
        failures = server.metrics()
    assert alive
    assert texts(replies) == baseline["prompts"]
    assert texts(replies_again) == baseline["prompts"]
    assert any(
        k.startswith("vllm:kv_offload_tiering_cascade_job_failures") and v > 0
        for k, v in failures.items()
    ), "no store job failed on a full store"


def test_a_bad_option_stops_vllm_at_start(checkpoint: Path, tmp_path: Path) -> None:
    config = spec_config(f"disk://{tmp_path / 'store'}", n_raed_threads=2)
    server = VllmServer(ServerOptions(checkpoint, config), tmp_path / "vllm.log")
    try:
        status = server.wait_exit()
    finally:
        server.stop(kill=True)
    assert status != 0
    assert "HiCacheOffloadingSpec has no option 'n_raed_threads'" in server.log_text()
