"""The serving measurements of ``hicache bench seed``: the prefill delayer and LPM against FCFS
through ``hicache serve``, and decode by context through ``hicache bench hisparse``.

Both run the existing commands in this process from their own parsers, with the defaults those
parsers give, so whatever the scheduler, the engine or HiSparse do today is what is measured.
A serve run is one configuration (device + host, no L3: ``--l3 none``) of a workload whose
requests all arrive at once (``--rate 0``); the two sides of a comparison alternate, round by
round, and each figure is the median of the rounds with their range.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import shlex
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any, NoReturn

from hicache.errors import InvalidArgumentError
from hicache.tools.bench.rounds import rotated, spread
from hicache.tools.cli_parsing import CommandFailed
from hicache.workloads.synthetic import BURST_CHAT, burst_conversations_trace
from hicache.workloads.traces import TraceRequest, dump_trace

__all__ = [
    "LPM_DOC_TOKENS",
    "check_burst",
    "check_contexts",
    "decode_by_context",
    "delayer",
    "lpm_vs_fcfs",
]

# A one-layer model (that of the burst replay in BENCHMARKS.md, issue 16): a run takes seconds,
# and what a prefix hit saves is most of a request's time.
_MODEL_FLAGS = "--rate 0 --l3 none --hidden 512 --layers 1 --heads 1 --kv-heads 1 --head-dim 32"
_BURST_DEVICE_TOKENS = 16384
_BURST_FLAGS = f"{_MODEL_FLAGS} --device-tokens {_BURST_DEVICE_TOKENS} --max-running 4"
# The LPM trace: serve's longdoc workload, documents of 3 x 512 tokens shared by four clients
# each, questions of 64; the device pool holds one document and a question or two, so the
# others' documents go to host, which holds the whole working set.
LPM_DOC_TOKENS = 3 * 512
_LPM_DEVICE_TOKENS = 2048
_LPM_FLAGS = (
    f"{_MODEL_FLAGS} --workload longdoc --system-tokens {LPM_DOC_TOKENS // 3} "
    f"--device-tokens {_LPM_DEVICE_TOKENS}"
)
_TIERS = ("hit_tokens_device", "hit_tokens_host")


def _serve(argv: Sequence[str]) -> dict[str, Any]:
    """``hicache serve ARGV --json -q`` run in this process: the row of its one configuration."""
    from hicache.tools.cli import build_parser

    full = ["serve", *argv, "--json", "-q"]
    args = build_parser(full).parse_args(full)
    args.argv = full
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.func(args)
    if code != 0:
        raise CommandFailed(f"hicache {shlex.join(full)} exited with {code}")
    row: dict[str, Any] = json.loads(out.getvalue())["configs"][0]
    if row["failed"]:
        raise CommandFailed(f"hicache {shlex.join(full)}: {row['failed']} requests failed")
    return row


def _alternate(sides: dict[str, list[str]], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Each side's serve row in each of ``rounds`` rounds; the sides take turns going first."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in rotated(list(sides), r):
            rows[name].append(_serve(sides[name]))
    return rows


def _ttft_ratio(ours: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, float]:
    """Mean TTFT of ours over the baseline's, per round: the median and range."""
    ratios = [o["ttft_mean_ms"] / b["ttft_mean_ms"] for o, b in zip(ours, base, strict=True)]
    return spread("ttft_ratio", ratios, 3)


def _median(rows: list[dict[str, Any]], key: str) -> Any:
    value = statistics.median(row[key] for row in rows)
    return round(value, 4) if isinstance(value, float) else value


def check_burst(conversations: int, turns: int) -> list[TraceRequest]:
    """The burst replay's requests; refused when one would not fit the device pool."""
    config = dataclasses.replace(BURST_CHAT, clients=conversations, rounds=turns)
    requests = burst_conversations_trace(config)
    longest = max(len(r.tokens) + len(r.output_tokens) for r in requests)
    if longest > _BURST_DEVICE_TOKENS:
        raise InvalidArgumentError(
            f"--burst-turns {turns} makes requests of up to {longest} tokens, more than the "
            f"{_BURST_DEVICE_TOKENS}-token device pool the burst replay runs on; lower it"
        )
    return requests


def delayer(conversations: int, turns: int, rounds: int) -> dict[str, Any]:
    """Mean TTFT with ``--delay-prefill`` over without, on the burst replay."""
    requests = check_burst(conversations, turns)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-seed-") as scratch:
        trace = os.path.join(scratch, "burst.jsonl")
        dump_trace(requests, trace)
        base = ["--trace", trace, *_BURST_FLAGS.split()]
        rows = _alternate({"with": [*base, "--delay-prefill"], "without": base}, rounds)
    return {
        **_ttft_ratio(rows["with"], rows["without"]),
        "hit_rate_with": _median(rows["with"], "hit_rate"),
        "hit_rate_without": _median(rows["without"], "hit_rate"),
        "ttft_mean_ms_with": _median(rows["with"], "ttft_mean_ms"),
        "ttft_mean_ms_without": _median(rows["without"], "ttft_mean_ms"),
        "held_requests_with": _median(rows["with"], "held_requests"),
        "requests": len(requests),
        "rounds": rounds,
        "serve_command": f"python -m hicache.tools.burst_trace BURST.jsonl --conversations "
        f"{conversations} --turns {turns}; hicache serve --json --trace BURST.jsonl "
        f"{_BURST_FLAGS} [--delay-prefill]",
    }


def lpm_vs_fcfs(clients: int, trace_rounds: int, rounds: int) -> dict[str, Any]:
    """Hit tokens by tier and mean TTFT with ``--schedule lpm`` against ``fcfs``."""
    documents = max(1, clients // 4)
    working_set = documents * LPM_DOC_TOKENS + clients * trace_rounds * 128
    host_ratio = math.ceil(working_set / _LPM_DEVICE_TOKENS) + 1
    flags = f"{_LPM_FLAGS} --clients {clients} --rounds {trace_rounds} --host-ratio {host_ratio}"
    sides = {name: [*flags.split(), "--schedule", name] for name in ("lpm", "fcfs")}
    rows = _alternate(sides, rounds)
    lpm, fcfs = rows["lpm"], rows["fcfs"]
    lpm_hits, fcfs_hits = (
        statistics.median(sum(row[tier] for tier in _TIERS) for row in side) for side in (lpm, fcfs)
    )
    return {
        "hit_tokens_ratio": round(lpm_hits / fcfs_hits, 3) if fcfs_hits else None,
        **_ttft_ratio(lpm, fcfs),
        **{f"lpm_{tier}": _median(lpm, tier) for tier in _TIERS},
        **{f"fcfs_{tier}": _median(fcfs, tier) for tier in _TIERS},
        "lpm_ttft_mean_ms": _median(lpm, "ttft_mean_ms"),
        "fcfs_ttft_mean_ms": _median(fcfs, "ttft_mean_ms"),
        "documents": documents,
        "requests": clients * trace_rounds,
        "rounds": rounds,
        "serve_command": f"hicache serve --json {flags} --schedule lpm|fcfs",
    }


def _refuse(message: str) -> NoReturn:
    raise InvalidArgumentError(f"bench hisparse refuses it ({message})")


def _hisparse_args(context: int, output_tokens: int) -> argparse.Namespace:
    """``hicache bench hisparse``'s arguments for one request at ``context`` in a budget of one
    context, from its own parser (its bounds refused as a typed error)."""
    from hicache.tools.bench.serving.hisparse import add_bench_hisparse_parser

    holder = argparse.ArgumentParser(prog="hicache bench")
    parser = add_bench_hisparse_parser(holder.add_subparsers())
    parser.error = _refuse  # type: ignore[method-assign]
    argv = f"--context {context} --output-tokens {output_tokens} --low 1 --high 1"
    return parser.parse_args([*argv.split(), "--budget-contexts", "1", "--json"])


def check_contexts(contexts: Sequence[int], output_tokens: int) -> None:
    """Refuse contexts ``bench hisparse`` cannot run, before anything is measured."""
    for context in contexts:
        try:
            _hisparse_args(context, output_tokens)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--contexts {context}: {exc}") from None


def decode_by_context(contexts: Sequence[int], output_tokens: int) -> list[dict[str, Any]]:
    """Decode tok/s of one request at each context, without and with HiSparse."""
    from hicache.tools.bench.serving.hisparse import run_bench_hisparse

    points: list[dict[str, Any]] = []
    for context in contexts:
        rows = run_bench_hisparse(_hisparse_args(context, output_tokens))
        without, with_ = (next(r for r in rows if r.get("hisparse") is s) for s in (False, True))
        summary = next(r for r in rows if r.get("summary"))
        points.append(
            {
                "context": context,
                "tok_s": without["decode_tok_s"],
                "tok_s_hisparse": with_["decode_tok_s"],
                "outputs_identical": summary["outputs_identical"],
                "device_bytes": without["device_bytes"],
                "device_bytes_hisparse": with_["device_bytes"],
                "output_tokens": output_tokens,
            }
        )
    first = points[0]
    for point in points:
        for key in ("tok_s", "tok_s_hisparse"):
            point[f"{key}_vs_first"] = round(point[key] / first[key], 3) if first[key] else None
    return points
