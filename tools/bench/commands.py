"""``hicache bench NAME``: benchmarks, each against a baseline measured in the same run.

Imported only when ``bench`` is run (see :mod:`hicache.tools.cli`). Its own subcommands are
built on demand the same way, so ``bench codec`` does not pay for the torch import that
``bench layouts`` and ``bench controller`` need. Each benchmark's parser sets ``bench_run``, a
function from the arguments to result rows, which :func:`_cmd_bench` prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from typing import Any

from hicache.tools.cli_parsing import (
    Command,
    add_commands,
    check_memory,
    input_dir,
    int_range,
    size_range,
    url_arg,
)

__all__ = [
    "BENCHMARKS",
    "add_bench",
    "add_bench_backends",
    "add_bench_cluster",
    "add_bench_codec",
    "add_bench_controller",
    "add_bench_hisparse",
    "add_bench_layouts",
    "add_bench_lmcache",
    "add_bench_radix",
    "add_bench_seed",
    "add_bench_sglang",
    "add_bench_tools",
    "add_bench_vllm",
    "add_bench_vllm_serve",
]

_HERE = "hicache.tools.bench.commands"
# Upper bounds of the benchmarks' sizes; what they need together is checked before a run.
_MAX_OBJECTS = 10_000_000
_MAX_OBJECT_BYTES = 1 << 30
_MAX_REPEATS = 1000
CODEC_MIN_BYTES = 256  # one row of 128 bf16 channels: the smallest KV-like page
# The benchmarks, in the order `hicache bench --help` lists them; each help is also its
# builder's (tests/tools/test_startup.py checks).
BENCHMARKS: dict[str, Command] = {
    "backends": Command("backend put/get vs raw I/O or memcpy", f"{_HERE}:add_bench_backends"),
    "codec": Command("page codec: compression ratio and speed", f"{_HERE}:add_bench_codec"),
    "tools": Command("inspect/verify vs a raw walk and read", f"{_HERE}:add_bench_tools"),
    "radix": Command(
        "replay a request trace through the radix tree (simulated, no KV)",
        f"{_HERE}:add_bench_radix",
    ),
    "layouts": Command(
        "layout conversions, gather and scatter vs a plain copy of the same bytes",
        f"{_HERE}:add_bench_layouts",
    ),
    "controller": Command(
        "controller CPU overhead per page, and L3 round trip vs raw file I/O",
        f"{_HERE}:add_bench_controller",
    ),
    "hisparse": Command(
        "long-context decode at a fixed device budget, with and without HiSparse",
        f"{_HERE}:add_bench_hisparse",
    ),
    "cluster": Command(
        "workers behind cache-aware and round-robin routers, over HTTP",
        f"{_HERE}:add_bench_cluster",
    ),
    "sglang": Command(
        "SGLang's page functions over the adapter vs SGLang's own backends",
        f"{_HERE}:add_bench_sglang",
    ),
    "lmcache": Command(
        "LMCache's storage manager over the plugin vs LMCache's local disk",
        f"{_HERE}:add_bench_lmcache",
    ),
    "vllm": Command(
        "vLLM's tier API over HiCacheTier vs vLLM's own fs tier", f"{_HERE}:add_bench_vllm"
    ),
    "vllm-serve": Command(
        "vllm serve with hicache: warm restart and a multi-turn trace vs vLLM alone",
        f"{_HERE}:add_bench_vllm_serve",
    ),
    "seed": Command(
        "each measured claim of the seed design, beside the seed's figure",
        f"{_HERE}:add_bench_seed",
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


# ----- benchmarks defined here: parsers only, their modules are imported when they run ----------
def add_bench_backends(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench backends``; its run imports :mod:`hicache.tools.bench.backends`."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "backends", help="backend put/get vs raw I/O or memcpy"
    )
    p.add_argument(
        "--backend", action="append", type=_backend_name, help="backend name (repeatable)"
    )
    p.add_argument("--url", type=url_arg, help="backend URL (with a single --backend)")
    p.add_argument("--objects", type=int_range(1, _MAX_OBJECTS), default=256)
    p.add_argument("--object-bytes", type=size_range(1, _MAX_OBJECT_BYTES), default=2 << 20)
    p.add_argument(
        "--repeats",
        type=int_range(1, _MAX_REPEATS),
        default=6,
        help="rounds (a multiple of 3 puts each side in each place equally): each figure is "
        "their median, with its range",
    )
    p.add_argument(
        "--dir", type=input_dir, help="scratch directory for file stores (default: temp)"
    )
    p.add_argument(
        "--open-objects",
        type=int_range(1, _MAX_OBJECTS),
        help="instead of put/get: time opening a disk (and file, up to 200000) store of this "
        "many 64-byte objects whose writer died (default backends: disk, file)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=_run_backends)
    return p


def _backend_name(text: str) -> str:
    """A registered backend's name (its client need not be installed: the run says so)."""
    from hicache.backends.registry import default_registry

    names = sorted(entry.name for entry in default_registry.entries())
    if text not in names:
        raise argparse.ArgumentTypeError(f"no backend {text!r}; registered: {', '.join(names)}")
    return text


def _run_backends(args: argparse.Namespace) -> list[dict[str, Any]]:
    from hicache.tools.bench.backends import BackendBenchConfig, run_backend_bench

    if args.open_objects:
        default: tuple[str, ...] = ("disk", "file")
    else:
        check_memory(args.objects * args.object_bytes * 2, "--objects x --object-bytes x 2")
        default = ("memory", "file", "shm")
    config = BackendBenchConfig(
        backends=tuple(args.backend or default),
        url=args.url,
        objects=args.objects,
        object_bytes=args.object_bytes,
        repeats=args.repeats,
        directory=args.dir,
        open_objects=args.open_objects or 0,
    )
    return asyncio.run(run_backend_bench(config))


def add_bench_codec(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench codec``; its run imports :mod:`hicache.tools.bench.codec`."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "codec", help="page codec: compression ratio and speed"
    )
    p.add_argument(
        "--object-bytes",
        type=size_range(CODEC_MIN_BYTES, _MAX_OBJECT_BYTES),
        default=2 << 20,
        help=f"bytes of KV-like data per page (at least {CODEC_MIN_BYTES})",
    )
    p.add_argument("--repeats", type=int_range(1, _MAX_REPEATS), default=5, help="best of N")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=_run_codec)
    return p


def _run_codec(args: argparse.Namespace) -> list[dict[str, Any]]:
    from hicache.tools.bench.codec import run_codec_bench

    return run_codec_bench(page_bytes=args.object_bytes, repeats=args.repeats)


def add_bench_tools(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench tools``; its run imports :mod:`hicache.tools.bench.store_tools`."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "tools", help="inspect/verify vs a raw walk and read"
    )
    p.add_argument("--small-objects", type=int_range(1, _MAX_OBJECTS), default=100_000)
    p.add_argument("--small-bytes", type=size_range(1, _MAX_OBJECT_BYTES), default=4096)
    p.add_argument("--large-objects", type=int_range(1, _MAX_OBJECTS), default=1000)
    p.add_argument("--large-bytes", type=size_range(1, _MAX_OBJECT_BYTES), default=2 << 20)
    p.add_argument("--repeats", type=int_range(1, _MAX_REPEATS), default=3, help="best of N")
    p.add_argument("--dir", type=input_dir, help="scratch directory (default: temp)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=_run_tools)
    return p


def _run_tools(args: argparse.Namespace) -> list[dict[str, Any]]:
    import shutil
    import tempfile

    from hicache.errors import ConfigError
    from hicache.tools.bench.store_tools import ToolsBenchConfig, run_tools_bench

    total = args.small_objects * args.small_bytes + args.large_objects * args.large_bytes
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if total > free:
        raise ConfigError(
            f"the stores need {total / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB "
            "free in the scratch directory; lower the object counts or sizes"
        )

    config = ToolsBenchConfig(
        small_objects=args.small_objects,
        small_bytes=args.small_bytes,
        large_objects=args.large_objects,
        large_bytes=args.large_bytes,
        repeats=args.repeats,
        directory=args.dir,
    )
    return asyncio.run(run_tools_bench(config))


# ----- benchmarks with their own modules, which bring their own --json --------------------------
def add_bench_radix(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench radix`` from :mod:`hicache.tools.bench.radix`, which defines it."""
    from hicache.tools.bench.radix import add_bench_radix_parser, run_bench_radix

    p = add_bench_radix_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_radix)
    return p


def add_bench_layouts(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench layouts`` from :mod:`hicache.tools.bench.layouts` (imports torch)."""
    from hicache.tools.bench.layouts import add_bench_layouts_parser, run_bench_layouts

    p = add_bench_layouts_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_layouts)
    return p


def add_bench_controller(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench controller`` from :mod:`hicache.tools.bench.controller` (imports torch)."""
    from hicache.tools.bench.controller import add_bench_controller_parser, run_bench_controller

    p = add_bench_controller_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_controller)
    return p


def add_bench_hisparse(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench hisparse`` from :mod:`hicache.tools.bench.hisparse` (imports torch)."""
    from hicache.tools.bench.hisparse import add_bench_hisparse_parser, run_bench_hisparse

    p = add_bench_hisparse_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_hisparse)
    return p


def add_bench_cluster(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench cluster`` from :mod:`hicache.tools.bench.cluster` (starts servers)."""
    from hicache.tools.bench.cluster import add_bench_cluster_parser, run_bench_cluster

    p = add_bench_cluster_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_cluster)
    return p


def add_bench_sglang(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench sglang`` from :mod:`hicache.tools.bench.sglang` (needs SGLang installed)."""
    from hicache.tools.bench.sglang import add_bench_sglang_parser, run_bench_sglang

    p = add_bench_sglang_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_sglang)
    return p


def add_bench_lmcache(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench lmcache`` from :mod:`hicache.tools.bench.lmcache` (needs LMCache installed)."""
    from hicache.tools.bench.lmcache import add_bench_lmcache_parser, run_bench_lmcache

    p = add_bench_lmcache_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_lmcache)
    return p


def add_bench_vllm(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench vllm`` from :mod:`hicache.tools.bench.vllm_tier` (needs vLLM installed)."""
    from hicache.tools.bench.vllm_tier import add_bench_vllm_parser, run_bench_vllm

    p = add_bench_vllm_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_vllm)
    return p


def add_bench_vllm_serve(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench vllm-serve`` from :mod:`hicache.tools.bench.vllm_serve` (needs vLLM's CPU
    build installed: it starts `vllm serve`)."""
    from hicache.tools.bench.vllm_serve import add_bench_vllm_serve_parser, run_bench_vllm_serve

    p = add_bench_vllm_serve_parser(bench_sub)
    p.set_defaults(bench_run=run_bench_vllm_serve)
    return p


def add_bench_seed(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench seed`` from :mod:`hicache.tools.bench.seed`, which prints its own result
    (one JSON object, or a table) instead of rows."""
    from hicache.tools.bench.seed import add_bench_seed_parser

    return add_bench_seed_parser(bench_sub)
