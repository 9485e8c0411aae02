"""The ``hicache`` command: thin argument parsing over library functions in ``hicache.tools``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence

from hicache.backends.registry import default_registry
from hicache.errors import HiCacheError

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


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "backends":
        from hicache.tools.bench_backends import BackendBenchConfig, run_backend_bench

        config = BackendBenchConfig(
            backends=tuple(args.backend or ("memory", "file", "shm")),
            url=args.url,
            objects=args.objects,
            object_bytes=args.object_bytes,
            repeats=args.repeats,
            directory=args.dir,
        )
        results = asyncio.run(run_backend_bench(config))
    else:
        from hicache.tools.bench_codec import run_codec_bench

        results = run_codec_bench(page_bytes=args.object_bytes, repeats=args.repeats)
    for row in results:
        if args.json:
            print(json.dumps(row))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    backends = sub.add_parser("backends", help="list registered storage backends")
    backends.add_argument("--json", action="store_true")
    backends.set_defaults(func=_cmd_backends)

    bench = sub.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    b_backends = bench_sub.add_parser("backends", help="backend put/get vs raw I/O or memcpy")
    b_backends.add_argument("--backend", action="append", help="backend name (repeatable)")
    b_backends.add_argument("--url", help="backend URL (with a single --backend)")
    b_backends.add_argument("--objects", type=int, default=256)
    b_backends.add_argument("--object-bytes", type=int, default=2 << 20)
    b_backends.add_argument("--repeats", type=int, default=3, help="best of N")
    b_backends.add_argument("--dir", help="scratch directory for file stores (default: temp)")
    b_backends.add_argument("--json", action="store_true")
    b_codec = bench_sub.add_parser("codec", help="page codec: compression ratio and speed")
    b_codec.add_argument("--object-bytes", type=int, default=2 << 20)
    b_codec.add_argument("--repeats", type=int, default=5, help="best of N")
    b_codec.add_argument("--json", action="store_true")
    bench.set_defaults(func=_cmd_bench)
    return parser


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
