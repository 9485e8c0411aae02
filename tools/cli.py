"""The ``hicache`` command: thin argument parsing over library functions in ``hicache.tools``.

Each subcommand lives in its own module, imported only when the command line names it (see
:mod:`hicache.tools.cli_parsing`), so ``hicache backends``, ``verify``, ``inspect``, ``compact``
and ``stats`` start without importing torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from hicache.errors import HiCacheError
from hicache.tools.cli_parsing import Command, CommandFailed, add_commands

__all__ = ["COMMANDS", "main"]

# The subcommands, in the order `hicache --help` lists them. Each help here is the one its
# builder gives too (tests/tools/test_startup.py checks), since the listing shows this one.
COMMANDS: dict[str, Command] = {
    "backends": Command("list registered storage backends", "hicache.tools.cli_info:add_backends"),
    "bench": Command(
        "benchmarks against a baseline measured in the same run",
        "hicache.tools.bench.commands:add_bench",
        nested=True,
    ),
    "inspect": Command(
        "what a store holds, from page headers", "hicache.tools.store.commands:add_inspect"
    ),
    "verify": Command(
        "read every object and check header and checksum", "hicache.tools.store.commands:add_verify"
    ),
    "compact": Command(
        "remove bad, orphaned, stale and over-budget pages",
        "hicache.tools.store.commands:add_compact",
    ),
    "stats": Command("the counters a backend keeps", "hicache.tools.store.commands:add_stats"),
    "config": Command(
        "check a tiered-cache config (file and flags) and print what takes effect",
        "hicache.tools.cli_info:add_config",
    ),
    "serve": Command(
        "serve a workload with the tiered cache (L3 on local disk by default)",
        "hicache.tools.serve.command:add_serve_parser",
    ),
}


class ExactFlagParser(argparse.ArgumentParser):
    """A parser that takes only whole flag names: ``--rate-l 5`` is an error, not
    ``--rate-limit 5``. The ``serve --workers`` launcher drops the router's own flags from
    its workers' command line by name, and an abbreviation would pass that filter. Subcommand
    parsers are made of the same class (argparse uses its parent's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The ``hicache`` parser, with the subcommand ``argv`` names built in full."""
    parser = ExactFlagParser(prog="hicache", description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub, COMMANDS, argv)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit status.

    0: done. 2: a usage error: argparse's own (usage and one ``error:`` line, raised as
    SystemExit), or one ``hicache: error:`` line for a value, a config or an input that cannot
    work (every :class:`HiCacheError`). 1: the command ran and failed
    (:class:`CommandFailed`, an OSError, anything unexpected), with one ``hicache: error:``
    line. A traceback is printed only with ``-v``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args.argv = argv  # `serve --workers` starts its workers with the same command line
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `hicache inspect --list | head`: the reader is gone, stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        code, message = _failure(exc)
        print(f"hicache: error: {message}", file=sys.stderr)
        return code


def _failure(exc: Exception) -> tuple[int, str]:
    """The exit status for ``exc`` and its message, on one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, CommandFailed):
        return 1, text
    if isinstance(exc, HiCacheError):
        return 2, text
    if isinstance(exc, OSError):  # an output file that cannot be written, a store gone mid-run
        return 1, text
    return 1, f"unexpected {type(exc).__name__}: {text} (run with -v for the traceback)"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
