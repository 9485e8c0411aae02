"""What the benchmarks' parsers share: the options most of them take, as
:class:`~hicache.tools.cli_parsing.Flag` rows for their option tables (the rounds to run, a
scratch directory, JSON output), and :func:`add_bench_parser`, which adds a benchmark from its
table. Each benchmark gives its own default and help, since what a round is differs from one to
the next."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from hicache.tools.bench.limits import MAX_REPEATS
from hicache.tools.cli_parsing import Flag, add_flags, input_dir, int_range

__all__ = ["JSON_LINES", "add_bench_parser", "repeats_flag", "scratch_dir_flag"]

JSON_LINES = Flag.switch("--json", "one JSON object per line")


def repeats_flag(default: int, help: str = "best of N", most: int = MAX_REPEATS) -> Flag:
    """``--repeats``: how many rounds, from 1 to ``most``."""
    return Flag("--repeats", int_range(1, most), default, help)


def scratch_dir_flag(help: str) -> Flag:
    """``--dir``: an existing directory the benchmark writes its stores or files under."""
    return Flag("--dir", input_dir, help=help)


def add_bench_parser(
    bench_sub: Any,
    name: str,
    help: str,
    flags: Iterable[Flag],
    run: Callable[[argparse.Namespace], list[dict[str, Any]]],
) -> argparse.ArgumentParser:
    """Add the benchmark ``name`` to the ``hicache bench`` subcommands ``bench_sub``, with the
    options ``flags``; ``run``, from the parsed arguments to the result rows, runs it."""
    p: argparse.ArgumentParser = bench_sub.add_parser(name, help=help)
    add_flags(p, flags)
    p.set_defaults(bench_run=run)
    return p
