"""``hicache inspect|verify|compact|stats URL``: open a store, run a library function, close.

Imported only when one of the four is run (see :mod:`hicache.tools.cli`). Nothing here, nor in
the library modules the handlers import, imports torch: these run on hosts that only hold a
store (tests/tools/test_startup.py checks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from hicache.backends.base import StorageBackend
from hicache.backends.file.maintenance import TEMP_GRACE_S
from hicache.errors import BackendUnavailableError, ConfigError, HiCacheError
from hicache.keys import validate_key_prefix
from hicache.tools.cli_parsing import (
    CommandFailed,
    Flag,
    add_flags,
    arg_type,
    duration_range,
    fields_from,
    int_range,
    output_file,
    size_range,
    url_arg,
)
from hicache.urls import scrub

if TYPE_CHECKING:
    from hicache.tools.progress import Progress

__all__ = ["add_compact", "add_inspect", "add_stats", "add_verify"]


def _on_store(
    url: str, work: Callable[[StorageBackend], Awaitable[int]], *, writes: bool = False
) -> int:
    """``work`` on the store at ``url``, opened read-only unless the command ``writes``: the
    commands that only read then work on a read-only mount or a snapshot, and change nothing.

    A URL that names no store is a usage error (exit 2); a store that is there but does not
    open (read-only for a command that writes, a service that does not answer) is a runtime
    failure (exit 1), as an unreachable L3 is for ``serve``.
    """
    from hicache.tools.store.scan import open_store, store_config

    try:
        store_config(url, read_only=not writes)  # raises the usage errors, before any open
    except HiCacheError as exc:
        raise ConfigError(scrub(str(exc), url)) from None  # no credential of the URL shown

    async def run() -> int:
        try:
            backend = await open_store(url, read_only=not writes)
        except BackendUnavailableError as exc:
            raise CommandFailed(scrub(str(exc), url)) from None
        try:
            return await work(backend)
        finally:
            await backend.close()

    return asyncio.run(run())


def _progress(args: argparse.Namespace) -> Callable[[str, int | None], Progress]:
    from hicache.tools.progress import Progress

    return lambda label, total: Progress(label, total, enabled=not args.quiet)


_MAX_PARALLEL = 256  # batches read at once, each into a buffer of its own
_MAX_PROCESSES = 1024
_WEEK_S = 7 * 86400.0
_CENTURY_S = 100 * 365 * 86400.0
_key_prefix = arg_type(validate_key_prefix)  # what inspect refused at run time, all refuse now


def _store_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument(
        "url", type=url_arg, help="store URL, e.g. file:///var/cache/hicache or shm://name"
    )
    if name != "stats":
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


# verify and compact both read batches.
_PARALLEL = Flag("--parallel", int_range(1, _MAX_PARALLEL), 2, "batches read at once")
_JSON = Flag.switch("--json")


def _print_report(
    as_json: bool, to_json: Callable[[], dict[str, Any]], lines: Callable[[], list[str]]
) -> None:
    """A report as one indented JSON object (``--json``) or as its text lines."""
    print(json.dumps(to_json(), indent=2) if as_json else "\n".join(lines()))


# ----- inspect ----------------------------------------------------------------------------------
def add_inspect(sub: Any) -> argparse.ArgumentParser:
    """Add ``inspect``: what a store holds, from page headers."""
    p = _store_parser(sub, "inspect", "what a store holds, from page headers")
    p.add_argument("--list", action="store_true", help="one row per object")
    p.add_argument("--format", choices=["table", "json", "parquet"], default="table")
    p.add_argument("--output", type=output_file, help="write to FILE (required for parquet)")
    p.add_argument("--prefix", type=_key_prefix, default="", help="only keys starting with this")
    p.set_defaults(func=_cmd_inspect)
    return p


def _cmd_inspect(args: argparse.Namespace) -> int:
    from hicache.tools.store.inspect import InspectOptions, OutputFormat, inspect_store

    options = InspectOptions(
        list_objects=args.list,
        fmt=OutputFormat(args.format),
        output=args.output,
        prefix=args.prefix,
    )

    async def work(backend: StorageBackend) -> int:
        with _progress(args)("inspect", None) as bar:
            await inspect_store(backend, options, sys.stdout, bar)
        return 0

    return _on_store(args.url, work)


# ----- verify -----------------------------------------------------------------------------------
# Each VerifyOptions field the command line sets, and its flag.
_VERIFY_FLAGS = {
    "delete_bad": Flag.switch("--delete-bad", "delete what is bad"),
    "prefix": Flag("--prefix", _key_prefix, "", "only keys starting with this"),
    "parallel": _PARALLEL,
}


def add_verify(sub: Any) -> argparse.ArgumentParser:
    """Add ``verify``: read every object and check header and checksum."""
    p = _store_parser(sub, "verify", "read every object and check header and checksum")
    processes = Flag(
        "--processes", int_range(0, _MAX_PROCESSES), 0,
        "worker processes for small objects (0: cores)",
    )  # fmt: skip
    add_flags(p, [_JSON, *_VERIFY_FLAGS.values(), processes])
    p.set_defaults(func=_cmd_verify)
    return p


def _cmd_verify(args: argparse.Namespace) -> int:
    from hicache.tools.store.verify import VerifyOptions, verify_store

    cores = os.cpu_count() or 1
    options = VerifyOptions(**fields_from(args, _VERIFY_FLAGS), processes=args.processes or cores)

    async def work(backend: StorageBackend) -> int:
        with _progress(args)("verify", None) as bar:
            report = await verify_store(backend, options, bar)
        _print_report(args.json, report.to_json, report.lines)
        return report.exit_code

    return _on_store(args.url, work, writes=args.delete_bad)


# ----- compact ----------------------------------------------------------------------------------
# Each CompactOptions field the command line sets before --json and --parallel, and its flag.
_COMPACT_FLAGS = {
    "max_bytes": Flag("--max-bytes", size_range(0, 1 << 60), help="e.g. 500G"),
    "max_age_s": Flag("--max-age", duration_range(_CENTURY_S), help="e.g. 7d, 12h"),
    "grace_s": Flag(
        "--grace", duration_range(_CENTURY_S), TEMP_GRACE_S,
        "keep temp files and orphans younger than this (default 15m)",
    ),
    "dry_run": Flag.switch("--dry-run", "print the plan, change nothing"),
    "headers_only": Flag.switch("--headers-only", "skip payload checksums"),
}  # fmt: skip


def add_compact(sub: Any) -> argparse.ArgumentParser:
    """Add ``compact``: remove bad, orphaned, stale and over-budget pages."""
    p = _store_parser(sub, "compact", "remove bad, orphaned, stale and over-budget pages")
    add_flags(p, [*_COMPACT_FLAGS.values(), _JSON, _PARALLEL])
    p.set_defaults(func=_cmd_compact)
    return p


def _cmd_compact(args: argparse.Namespace) -> int:
    from hicache.tools.store.compact import CompactOptions, compact_store

    options = CompactOptions(**fields_from(args, _COMPACT_FLAGS), parallel=args.parallel)

    async def work(backend: StorageBackend) -> int:
        report = await compact_store(backend, options, _progress(args))
        verbose = args.dry_run or args.verbose
        _print_report(args.json, report.to_json, lambda: report.lines(verbose=verbose))
        return 0

    # Even with --dry-run: the plan is only worth having for a store compact could change.
    return _on_store(args.url, work, writes=True)


# ----- stats ------------------------------------------------------------------------------------
def add_stats(sub: Any) -> argparse.ArgumentParser:
    """Add ``stats``: the counters a backend keeps, once or every ``--watch`` seconds."""
    p = _store_parser(sub, "stats", "the counters a backend keeps")
    p.add_argument("--watch", type=duration_range(_WEEK_S), help="refresh every N seconds")
    p.add_argument("--count", type=int_range(1, 1 << 31), help="with --watch: stop after N reports")
    p.add_argument("--json", action="store_true", help="one JSON object per report")
    p.set_defaults(func=_cmd_stats)
    return p


def _cmd_stats(args: argparse.Namespace) -> int:
    from hicache.tools.store.stats import StatsOptions, watch_stats

    options = StatsOptions(watch_s=args.watch, count=args.count, as_json=args.json)

    async def work(backend: StorageBackend) -> int:
        await watch_stats(backend, options, sys.stdout)
        return 0

    try:
        return _on_store(args.url, work)
    except KeyboardInterrupt:  # the way out of --watch
        return 0
