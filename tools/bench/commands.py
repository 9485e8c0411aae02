"""``hicache bench NAME``: benchmarks, each against a baseline measured in the same run.

Imported only when ``bench`` is run (see :mod:`hicache.tools.cli`). Its own subcommands are
built on demand the same way: :data:`BENCHMARKS` names each one's parser builder as
``module:function``, and only the named benchmark's module is imported, so ``bench codec`` does
not pay for the torch import that ``bench layouts`` and ``bench controller`` need. Each builder
sets ``bench_run``, a function from the arguments to result rows, which :func:`_cmd_bench`
prints (``bench seed`` sets ``func`` instead: it prints its own result).

The benchmarks live in folders by what they measure: ``stores/`` (backends and their raw
baselines, the store tools), ``engines/`` (SGLang, LMCache, vLLM), ``cache/`` (codec, layouts,
radix tree, controller), ``serving/`` (HiSparse, the cluster), ``seed/``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hicache.tools.cli_parsing import Command, add_commands

__all__ = ["BENCHMARKS", "add_bench"]

_BENCH = "hicache.tools.bench"
# The benchmarks, in the order `hicache bench --help` lists them; each help is also its
# builder's (tests/tools/test_startup.py checks).
BENCHMARKS: dict[str, Command] = {
    "backends": Command(
        "backend put/get vs raw I/O or memcpy",
        f"{_BENCH}.stores.backends:add_bench_backends_parser",
    ),
    "codec": Command(
        "page codec: compression ratio and speed", f"{_BENCH}.cache.codec:add_bench_codec_parser"
    ),
    "tools": Command(
        "inspect/verify vs a raw walk and read",
        f"{_BENCH}.stores.store_tools:add_bench_tools_parser",
    ),
    "radix": Command(
        "replay a request trace through the radix tree (simulated, no KV)",
        f"{_BENCH}.cache.radix:add_bench_radix_parser",
    ),
    "layouts": Command(
        "layout conversions, gather and scatter vs a plain copy of the same bytes",
        f"{_BENCH}.cache.layouts:add_bench_layouts_parser",
    ),
    "controller": Command(
        "controller CPU overhead per page, and L3 round trip vs raw file I/O",
        f"{_BENCH}.cache.controller:add_bench_controller_parser",
    ),
    "hisparse": Command(
        "long-context decode at a fixed device budget, with and without HiSparse",
        f"{_BENCH}.serving.hisparse:add_bench_hisparse_parser",
    ),
    "cluster": Command(
        "workers behind cache-aware and round-robin routers, over HTTP",
        f"{_BENCH}.serving.cluster:add_bench_cluster_parser",
    ),
    "sglang": Command(
        "SGLang's page functions over the adapter vs SGLang's own backends",
        f"{_BENCH}.engines.sglang:add_bench_sglang_parser",
    ),
    "lmcache": Command(
        "LMCache's storage manager over the plugin vs LMCache's local disk",
        f"{_BENCH}.engines.lmcache:add_bench_lmcache_parser",
    ),
    "vllm": Command(
        "vLLM's tier API over HiCacheTier vs vLLM's own fs tier",
        f"{_BENCH}.engines.vllm_tier:add_bench_vllm_parser",
    ),
    "vllm-serve": Command(
        "vllm serve with hicache: warm restart and a multi-turn trace vs vLLM alone",
        f"{_BENCH}.engines.vllm_serve:add_bench_vllm_serve_parser",
    ),
    "seed": Command(
        "each measured claim of the seed design, beside the seed's figure",
        f"{_BENCH}.seed.seed:add_bench_seed_parser",
    ),
}


def add_bench(sub: Any, rest: Sequence[str]) -> argparse.ArgumentParser:
    """Add ``bench``, with the benchmark ``rest`` names built in full."""
    bench: argparse.ArgumentParser = sub.add_parser(
        "bench", help="benchmarks against a baseline measured in the same run"
    )
    bench.set_defaults(func=_cmd_bench)
    add_commands(bench.add_subparsers(dest="bench", required=True), BENCHMARKS, rest)
    return bench


def _cmd_bench(args: argparse.Namespace) -> int:
    for row in args.bench_run(args):
        if args.json:
            print(json.dumps(row))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0
