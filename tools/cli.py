"""The ``hicache`` command: thin argument parsing over library functions in ``hicache.tools``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from hicache.backends.base import TEMP_GRACE_S, StorageBackend
from hicache.backends.registry import default_registry
from hicache.errors import HiCacheError
from hicache.typed_config import parse_duration, parse_size

if TYPE_CHECKING:
    from hicache.tools.progress import Progress

__all__ = ["main"]


def _cmd_backends(args: argparse.Namespace) -> int:
    rows = []
    for entry in default_registry.entries():
        row: dict[str, object] = {
            "name": entry.name,
            "schemes": list(entry.schemes),
            "origin": entry.origin,
            "target": entry.target_path,
        }
        try:
            cls = default_registry.load(entry.name)
        except HiCacheError as exc:
            row["available"] = False
            row["error"] = str(exc)
        else:
            caps = cls.capabilities
            row["available"] = True
            row["schemes"] = sorted(set(entry.schemes) | set(cls.url_schemes))
            row["capabilities"] = [
                name
                for name in ("persistent", "shared_across_processes", "zero_copy", "listable")
                if getattr(caps, name)
            ]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<10} {'schemes':<18} {'capabilities':<44} origin")
    for row in rows:
        schemes = ",".join(f"{s}://" for s in row["schemes"]) or "-"  # type: ignore[attr-defined]
        if row["available"]:
            shown = ",".join(row["capabilities"]) or "-"  # type: ignore[arg-type]
        else:
            shown = f"unavailable: {row['error']}"
        print(f"{row['name']:<10} {schemes:<18} {shown:<44} {row['origin']} [{row['target']}]")
    return 0


def _print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    for row in rows:
        if as_json:
            print(json.dumps(row))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()))


def _bench_backends(args: argparse.Namespace) -> list[dict[str, Any]]:
    from hicache.tools.bench_backends import BackendBenchConfig, run_backend_bench

    config = BackendBenchConfig(
        backends=tuple(args.backend or ("memory", "file", "shm")),
        url=args.url,
        objects=args.objects,
        object_bytes=args.object_bytes,
        repeats=args.repeats,
        directory=args.dir,
    )
    return asyncio.run(run_backend_bench(config))


def _bench_codec(args: argparse.Namespace) -> list[dict[str, Any]]:
    from hicache.tools.bench_codec import run_codec_bench

    return run_codec_bench(page_bytes=args.object_bytes, repeats=args.repeats)


def _bench_tools(args: argparse.Namespace) -> list[dict[str, Any]]:
    from hicache.tools.bench_tools import ToolsBenchConfig, run_tools_bench

    config = ToolsBenchConfig(
        small_objects=args.small_objects,
        small_bytes=args.small_bytes,
        large_objects=args.large_objects,
        large_bytes=args.large_bytes,
        repeats=args.repeats,
        directory=args.dir,
    )
    return asyncio.run(run_tools_bench(config))


def _cmd_bench(args: argparse.Namespace) -> int:
    _print_rows(args.bench_run(args), args.json)
    return 0


# ----- store commands: open the URL, run a library function, close ------------------------------
def _on_store(url: str, work: Callable[[StorageBackend], Awaitable[int]]) -> int:
    from hicache.tools.store_scan import open_store

    async def run() -> int:
        backend = await open_store(url)
        try:
            return await work(backend)
        finally:
            await backend.close()

    return asyncio.run(run())


def _progress(args: argparse.Namespace) -> Callable[[str, int | None], Progress]:
    from hicache.tools.progress import Progress

    return lambda label, total: Progress(label, total, enabled=not args.quiet)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from hicache.tools.inspect import InspectOptions, OutputFormat, inspect_store

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


def _cmd_verify(args: argparse.Namespace) -> int:
    from hicache.tools.verify import VerifyOptions, verify_store

    options = VerifyOptions(
        delete_bad=args.delete_bad,
        prefix=args.prefix,
        parallel=args.parallel,
        processes=args.processes or (os.cpu_count() or 1),
    )

    async def work(backend: StorageBackend) -> int:
        with _progress(args)("verify", None) as bar:
            report = await verify_store(backend, options, bar)
        if args.json:
            print(json.dumps(report.to_json(), indent=2))
        else:
            print("\n".join(report.lines()))
        return report.exit_code

    return _on_store(args.url, work)


def _cmd_compact(args: argparse.Namespace) -> int:
    from hicache.tools.compact import CompactOptions, compact_store

    options = CompactOptions(
        max_bytes=args.max_bytes,
        max_age_s=args.max_age,
        dry_run=args.dry_run,
        grace_s=args.grace,
        headers_only=args.headers_only,
        parallel=args.parallel,
    )

    async def work(backend: StorageBackend) -> int:
        report = await compact_store(backend, options, _progress(args))
        if args.json:
            print(json.dumps(report.to_json(), indent=2))
        else:
            print("\n".join(report.lines(verbose=args.dry_run or args.verbose)))
        return 0

    return _on_store(args.url, work)


def _cmd_stats(args: argparse.Namespace) -> int:
    from hicache.tools.store_stats import StatsOptions, watch_stats

    options = StatsOptions(watch_s=args.watch, count=args.count, as_json=args.json)

    async def work(backend: StorageBackend) -> int:
        await watch_stats(backend, options, sys.stdout)
        return 0

    try:
        return _on_store(args.url, work)
    except KeyboardInterrupt:  # the way out of --watch
        return 0


# ----- the parser ---------------------------------------------------------------------------------
def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _add_bench(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    bench.set_defaults(func=_cmd_bench)
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    # Each benchmark: a subparser whose `bench_run` returns rows; all accept --json.
    b_backends = bench_sub.add_parser("backends", help="backend put/get vs raw I/O or memcpy")
    b_backends.add_argument("--backend", action="append", help="backend name (repeatable)")
    b_backends.add_argument("--url", help="backend URL (with a single --backend)")
    b_backends.add_argument("--objects", type=int, default=256)
    b_backends.add_argument("--object-bytes", type=int, default=2 << 20)
    b_backends.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="best of N rounds; a multiple of 3 puts each side in each place equally",
    )
    b_backends.add_argument("--dir", help="scratch directory for file stores (default: temp)")
    b_backends.set_defaults(bench_run=_bench_backends)
    b_codec = bench_sub.add_parser("codec", help="page codec: compression ratio and speed")
    b_codec.add_argument("--object-bytes", type=int, default=2 << 20)
    b_codec.add_argument("--repeats", type=int, default=5, help="best of N")
    b_codec.set_defaults(bench_run=_bench_codec)
    b_tools = bench_sub.add_parser("tools", help="inspect/verify vs a raw walk and read")
    b_tools.add_argument("--small-objects", type=int, default=100_000)
    b_tools.add_argument("--small-bytes", type=_arg_type(parse_size), default=4096)
    b_tools.add_argument("--large-objects", type=int, default=1000)
    b_tools.add_argument("--large-bytes", type=_arg_type(parse_size), default=2 << 20)
    b_tools.add_argument("--repeats", type=int, default=3, help="best of N")
    b_tools.add_argument("--dir", help="scratch directory (default: temp)")
    b_tools.set_defaults(bench_run=_bench_tools)
    for b in (b_backends, b_codec, b_tools):
        b.add_argument("--json", action="store_true", help="one JSON object per line")
    # These two bring their own --json; their modules import torch-heavy code only when run.
    from hicache.tools.bench_controller import (
        add_bench_controller_parser,
        run_bench_controller,
    )
    from hicache.tools.bench_layouts import add_bench_layouts_parser, run_bench_layouts
    from hicache.tools.bench_radix import add_bench_radix_parser, run_bench_radix

    add_bench_radix_parser(bench_sub).set_defaults(bench_run=run_bench_radix)
    add_bench_layouts_parser(bench_sub).set_defaults(bench_run=run_bench_layouts)
    add_bench_controller_parser(bench_sub).set_defaults(bench_run=run_bench_controller)


def _store_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("url", help="store URL, e.g. file:///var/cache/hicache or shm://name")
    if name != "stats":
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def _add_store_commands(sub: Any) -> None:
    inspect = _store_parser(sub, "inspect", "what a store holds, from page headers")
    inspect.add_argument("--list", action="store_true", help="one row per object")
    inspect.add_argument("--format", choices=["table", "json", "parquet"], default="table")
    inspect.add_argument("--output", help="write to FILE (required for parquet)")
    inspect.add_argument("--prefix", default="", help="only keys starting with this")
    inspect.set_defaults(func=_cmd_inspect)

    verify = _store_parser(sub, "verify", "read every object and check header and checksum")
    verify.add_argument("--json", action="store_true")
    verify.add_argument("--delete-bad", action="store_true", help="delete what is bad")
    verify.add_argument("--prefix", default="", help="only keys starting with this")
    verify.add_argument("--parallel", type=int, default=2, help="batches read at once")
    verify.add_argument(
        "--processes", type=int, default=0, help="worker processes for small objects (0: cores)"
    )
    verify.set_defaults(func=_cmd_verify)

    compact = _store_parser(sub, "compact", "remove bad, orphaned, stale and over-budget pages")
    compact.add_argument("--max-bytes", type=_arg_type(parse_size), help="e.g. 500G")
    compact.add_argument("--max-age", type=_arg_type(parse_duration), help="e.g. 7d, 12h")
    compact.add_argument(
        "--grace",
        type=_arg_type(parse_duration),
        default=TEMP_GRACE_S,
        help="keep temp files and orphans younger than this (default 15m)",
    )
    compact.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    compact.add_argument("--headers-only", action="store_true", help="skip payload checksums")
    compact.add_argument("--json", action="store_true")
    compact.add_argument("--parallel", type=int, default=2, help="batches read at once")
    compact.set_defaults(func=_cmd_compact)

    stats = _store_parser(sub, "stats", "the counters a backend keeps")
    stats.add_argument("--watch", type=_arg_type(parse_duration), help="refresh every N seconds")
    stats.add_argument("--count", type=int, help="with --watch: stop after N reports")
    stats.add_argument("--json", action="store_true", help="one JSON object per report")
    stats.set_defaults(func=_cmd_stats)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    backends = sub.add_parser("backends", help="list registered storage backends")
    backends.add_argument("--json", action="store_true")
    backends.set_defaults(func=_cmd_backends)
    _add_bench(sub)
    _add_store_commands(sub)
    _add_config_command(sub)
    from hicache.tools.serve import add_serve_parser

    add_serve_parser(sub)
    return parser


def _cmd_config(args: argparse.Namespace) -> int:
    import dataclasses
    import enum

    from hicache.tiering.config import check_config
    from hicache.tools.config_flags import config_from_args

    config = config_from_args(args)
    check_config(config, args.page_size)

    def plain(value: Any) -> Any:
        return getattr(value, "label", value.value) if isinstance(value, enum.Enum) else value

    table = {
        section: {k: plain(v) for k, v in dataclasses.asdict(getattr(config, section)).items()}
        for section in ("tiers", "prefetch", "storage")
    }
    print(json.dumps(table, indent=2))
    return 0


def _add_config_command(sub: Any) -> None:
    from hicache.tools.config_flags import add_hicache_flags

    p = sub.add_parser(
        "config", help="check a tiered-cache config (file and flags) and print what takes effect"
    )
    p.add_argument("--page-size", type=int, default=64, help="the pools' page size")
    add_hicache_flags(p)
    p.set_defaults(func=_cmd_config)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except HiCacheError as exc:
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hicache inspect --list | head`: the reader is gone, stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1
    except OSError as exc:  # an output file that cannot be written, a store gone mid-run
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
