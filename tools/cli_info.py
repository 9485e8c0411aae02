"""``hicache backends`` and ``hicache config``: what is installed, and what a config means.

Imported only when one of the two is run (see :mod:`hicache.tools.cli`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hicache.errors import HiCacheError

__all__ = ["add_backends", "add_config"]

_CAPABILITIES = ("persistent", "shared_across_processes", "zero_copy", "listable")


def add_backends(sub: Any) -> argparse.ArgumentParser:
    """Add ``backends``: list the registered storage backends."""
    p: argparse.ArgumentParser = sub.add_parser("backends", help="list registered storage backends")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_backends)
    return p


def _backend_rows() -> list[dict[str, Any]]:
    """One row per registered backend; loading each tells whether its client is installed."""
    from hicache.backends.registry import default_registry

    rows = []
    for entry in default_registry.entries():
        row: dict[str, Any] = {
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
            row["available"] = True
            row["schemes"] = sorted(set(entry.schemes) | set(cls.url_schemes))
            row["capabilities"] = [n for n in _CAPABILITIES if getattr(cls.capabilities, n)]
        rows.append(row)
    return rows


def _cmd_backends(args: argparse.Namespace) -> int:
    rows = _backend_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<10} {'schemes':<18} {'capabilities':<44} origin")
    for row in rows:
        schemes = ",".join(f"{s}://" for s in row["schemes"]) or "-"
        if row["available"]:
            shown = ",".join(row["capabilities"]) or "-"
        else:
            shown = f"unavailable: {row['error']}"
        print(f"{row['name']:<10} {schemes:<18} {shown:<44} {row['origin']} [{row['target']}]")
    return 0


def add_config(sub: Any) -> argparse.ArgumentParser:
    """Add ``config``: check a tiered-cache config and print the values that take effect."""
    from hicache.tools.cli_parsing import int_range
    from hicache.tools.config_flags import add_hicache_flags

    p: argparse.ArgumentParser = sub.add_parser(
        "config", help="check a tiered-cache config (file and flags) and print what takes effect"
    )
    p.add_argument(
        "--page-size", type=int_range(1, 1 << 16), default=64, help="the pools' page size"
    )
    add_hicache_flags(p)
    p.set_defaults(func=_cmd_config)
    return p


def _cmd_config(args: argparse.Namespace) -> int:
    import dataclasses
    import enum

    from hicache.tiering.common.config import check_config
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
