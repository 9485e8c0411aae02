"""``hicache bench seed``: each measured claim of the seed design, on this machine, beside the
seed's own figure, as one JSON object (``--json``) or a table.

Every figure is a ratio against a baseline measured in the same run, through the code the
claim is about (see :mod:`hicache.tools.bench.seed.seed_cache` and
:mod:`hicache.tools.bench.seed.seed_serve`):

* ``layout_host_io``: bytes/s of pages host -> L3 -> host through the controller's storage tier
  with ``page_first`` host pools over ``layer_first`` ones (``ratio``; seed about 2);
* ``slru_vs_lru``: radix-tree hit rate of SLRU over LRU on the multi-turn trace at a capacity
  that forces eviction (``ratio``; seed: SLRU wins at high reuse);
* ``delayer``: mean TTFT of ``hicache serve --delay-prefill`` over without on the burst replay
  (``ttft_ratio``), with both hit rates;
* ``lpm_vs_fcfs``: hit tokens and mean TTFT of ``--schedule lpm`` over ``fcfs`` on shared
  documents whose prefixes the small device pool evicts to host (``hit_tokens_ratio``,
  ``ttft_ratio``), with the hit tokens of each tier;
* ``decode_by_context``: a list, one point per ``--contexts`` value: decode tok/s of one request
  without and with HiSparse (``hicache bench hisparse``), and each rate over the first
  context's;
* ``io_kernel``: the CUDA I/O kernel's gather and scatter against a loop of one
  ``cudaMemcpyAsync`` per page, layer and K/V (``ratio``: the lower of the two; seed 3x),
  skipped without CUDA (:mod:`hicache.tools.bench.cache.io_kernel`).

Every object (each point of ``decode_by_context``) carries ``seed``, the seed's figure or claim,
and ``command``, the command line that measures it alone at the same sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hicache.tools.bench.bench_flags import repeats_flag, scratch_dir_flag
from hicache.tools.cli_parsing import (
    Flag,
    add_flags,
    arg_type,
    check_memory,
    float_range,
    int_range,
)

__all__ = ["MEASUREMENTS", "add_bench_seed_parser", "run_bench_seed"]

_MAX_CONTEXTS = 16
_IO_PAGE_BYTES = 2 << 20  # seed_cache's L3 pages
_KERNEL_PAGE_BYTES = 4 << 20  # io_kernel's pages: Llama-3-8B's KV of 32 tokens


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


Result = dict[str, Any] | list[dict[str, Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """One claim: the seed's figure, the flags that size it, how it runs and how the table
    shows its result."""

    seed: str | float
    flags: tuple[str, ...]  # argparse dests
    run: Callable[[argparse.Namespace], Result]
    shown: Callable[[dict[str, Any]], str]


def _layout_host_io(args: argparse.Namespace) -> Result:
    from hicache.tools.bench.seed.seed_cache import layout_host_io

    return layout_host_io(args.io_pages, args.repeats, args.dir)


def _slru_vs_lru(args: argparse.Namespace) -> Result:
    from hicache.tools.bench.seed.seed_cache import slru_vs_lru

    return slru_vs_lru(args.slru_clients, args.slru_rounds, args.capacity_share)


def _delayer(args: argparse.Namespace) -> Result:
    from hicache.tools.bench.seed.seed_serve import delayer

    return delayer(args.burst_conversations, args.burst_turns, args.repeats)


def _lpm_vs_fcfs(args: argparse.Namespace) -> Result:
    from hicache.tools.bench.seed.seed_serve import lpm_vs_fcfs

    return lpm_vs_fcfs(args.lpm_clients, args.lpm_rounds, args.repeats)


def _decode_by_context(args: argparse.Namespace) -> Result:
    from hicache.tools.bench.seed.seed_serve import decode_by_context

    return decode_by_context(args.contexts, args.decode_tokens)


def _io_kernel(args: argparse.Namespace) -> Result:
    from hicache.tools.bench.seed.seed_cache import io_kernel

    return io_kernel(args.kernel_pages, args.repeats)


def _ranged(r: dict[str, Any], name: str) -> str:
    return f"{r[name]} ({r[f'{name}_min']}-{r[f'{name}_max']})"


MEASUREMENTS: dict[str, Measurement] = {
    "layout_host_io": Measurement(
        2.0,
        ("io_pages", "repeats"),
        _layout_host_io,
        lambda r: f"page_first / layer_first bytes/s {_ranged(r, 'ratio')}",
    ),
    "slru_vs_lru": Measurement(
        "SLRU beats LRU at high reuse (ratio > 1)",
        ("slru_clients", "slru_rounds", "capacity_share"),
        _slru_vs_lru,
        lambda r: f"hit rate {r['hit_rate_slru']} / {r['hit_rate_lru']} = {r['ratio']}",
    ),
    "delayer": Measurement(
        "no figure: holding prefill while queued requests share prefixes raises the hits",
        ("burst_conversations", "burst_turns", "repeats"),
        _delayer,
        lambda r: (
            f"TTFT {_ranged(r, 'ttft_ratio')}; hit rate "
            f"{r['hit_rate_with']} with, {r['hit_rate_without']} without"
        ),
    ),
    "lpm_vs_fcfs": Measurement(
        "no figure: LPM (longest cached prefix first) serves more from cache than FCFS",
        ("lpm_clients", "lpm_rounds", "repeats"),
        _lpm_vs_fcfs,
        lambda r: f"hit tokens {r['hit_tokens_ratio']}; TTFT {_ranged(r, 'ttft_ratio')}",
    ),
    "decode_by_context": Measurement(
        "266 -> 240 tok/s from 4K to 900K with HiSparse on an H200 (a GPU figure: compare "
        "tok_s_hisparse_vs_first with 0.90)",
        ("contexts", "decode_tokens"),
        _decode_by_context,
        lambda r: (
            f"{r['context']}: {r['tok_s']} tok/s, {r['tok_s_hisparse']} with HiSparse "
            f"(x{r['tok_s_vs_first']} / x{r['tok_s_hisparse_vs_first']} of the first)"
        ),
    ),
    "io_kernel": Measurement(
        3.0,
        ("kernel_pages", "repeats"),
        _io_kernel,
        lambda r: (
            f"skipped: {r['skipped']}"
            if "skipped" in r
            else f"x{r['ratio']} (gather {_ranged(r['gather'], 'ratio')}, "
            f"scatter {_ranged(r['scatter'], 'ratio')})"
        ),
    ),
}


# ----- command line ---------------------------------------------------------------------------
def _contexts(text: str) -> list[int]:
    """Comma-separated distinct positive token counts, e.g. ``4096,16384,65536``."""
    parts = [part.strip() for part in text.split(",")]
    values = [int(part) for part in parts]
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError("must be distinct positive token counts, e.g. 4096,16384")
    if len(values) > _MAX_CONTEXTS:
        raise ValueError(f"at most {_MAX_CONTEXTS} contexts")
    return values


_FLAGS = (
    Flag(
        "--only", nargs="+", action="extend", choices=list(MEASUREMENTS), metavar="NAME",
        help=f"measure only these ({', '.join(MEASUREMENTS)}; default: all)",
    ),
    repeats_flag(
        5, "rounds of each paired measurement (layout_host_io, delayer, lpm_vs_fcfs)", most=100
    ),
    Flag(
        "--io-pages", int_range(1, 1 << 12), 32,
        "layout_host_io: 2 MiB pages each round writes to L3 and reads back per layout",
    ),
    scratch_dir_flag(
        "layout_host_io: where the disk:// L3 lives (default: /dev/shm when there is one, "
        "so the figure is the layouts', not a disk's writeback; else the temp directory)"
    ),
    Flag(
        "--kernel-pages", int_range(1, 1 << 12), 128,
        "io_kernel: 4 MiB pages (Llama-3-8B's KV, 32 tokens) each copy moves",
    ),
    # The sizes of the generated workloads.
    Flag("--slru-clients", int_range(1, 100_000), 128),
    Flag("--slru-rounds", int_range(1, 100), 8),
    Flag(
        "--capacity-share", float_range(0.0, 1.0, low_open=True), 0.25,
        "slru_vs_lru: the cache's capacity as a share of the trace's unique tokens",
    ),
    Flag("--burst-conversations", int_range(1, 1000), 8),
    Flag("--burst-turns", int_range(1, 100), 4),
    Flag(
        "--lpm-clients", int_range(1, 1000), 16,
        "lpm_vs_fcfs: clients of serve's longdoc workload (four to a document)",
    ),
    Flag("--lpm-rounds", int_range(1, 100), 4),
    Flag(
        "--contexts", arg_type(_contexts), [4096, 16384, 65536],
        "decode_by_context: prompt tokens, comma-separated (default 4096,16384,65536; "
        "each point prefills its prompt once, and that prefill, where every query scores every "
        "cached key, grows with the square of the context: 65536 takes minutes on a CPU)",
    ),
    Flag(
        "--decode-tokens", int_range(2, 1 << 14), 32,
        "decode_by_context: tokens each request generates",
    ),
    Flag.switch("--json", "one JSON object"),
)  # fmt: skip


def add_bench_seed_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``seed`` to the ``hicache bench`` subcommands; it runs :func:`run_bench_seed`."""
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "seed", help="each measured claim of the seed design, beside the seed's figure"
    )
    add_flags(p, _FLAGS)
    p.set_defaults(func=run_bench_seed)
    return p


def command_of(name: str, args: argparse.Namespace, context: int | None = None) -> str:
    """The command line that measures ``name`` alone at ``args``' sizes (one ``context``)."""
    words = ["hicache", "bench", "seed", "--only", name]
    for dest in MEASUREMENTS[name].flags:
        value = getattr(args, dest)
        if dest == "contexts":
            value = ",".join(str(c) for c in ([context] if context is not None else value))
        words += [f"--{dest.replace('_', '-')}", str(value)]
    return shlex.join([*words, "--json"])


def _check(names: Sequence[str], args: argparse.Namespace) -> None:
    """Refuse what a measurement cannot run, before any runs."""
    if "layout_host_io" in names:  # two layouts' host pools of 2 x pages each
        check_memory(4 * args.io_pages * _IO_PAGE_BYTES, "4 x --io-pages x 2 MiB")
    if "io_kernel" in names and torch_cuda():  # a pool and a pinned buffer of 2 x pages
        check_memory(2 * args.kernel_pages * _KERNEL_PAGE_BYTES, "2 x --kernel-pages x 4 MiB")
    if "delayer" in names:
        from hicache.tools.bench.seed.seed_serve import check_burst

        check_burst(args.burst_conversations, args.burst_turns)
    if "decode_by_context" in names:
        from hicache.tools.bench.seed.seed_serve import check_contexts

        check_contexts(args.contexts, args.decode_tokens)


def measure(args: argparse.Namespace) -> dict[str, Result]:
    """Each chosen measurement's result, with its seed figure and command."""
    names = [name for name in MEASUREMENTS if name in (args.only or MEASUREMENTS)]
    _check(names, args)
    results: dict[str, Result] = {}
    for name in names:
        result = MEASUREMENTS[name].run(args)
        seed = MEASUREMENTS[name].seed
        if isinstance(result, list):
            for point in result:
                point.update(seed=seed, command=command_of(name, args, point["context"]))
        else:
            result.update(seed=seed, command=command_of(name, args))
        results[name] = result
    return results


def run_bench_seed(args: argparse.Namespace) -> int:
    """Run ``hicache bench seed``: one JSON object, or the table."""
    results = measure(args)
    if args.json:
        print(json.dumps(results, allow_nan=False))
    else:
        print_table(results, sys.stdout)
    return 0


def print_table(results: dict[str, Result], out: Any) -> None:
    """One row per measurement (per point of a list): ours, the seed's, the command."""
    print("measurement | ours | seed | command", file=out)
    for name, result in results.items():
        shown = MEASUREMENTS[name].shown
        for row in result if isinstance(result, list) else [result]:
            print(f"{name} | {shown(row)} | {row['seed']} | {row['command']}", file=out)
