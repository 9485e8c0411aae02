"""The tiered cache's CLI flags: ``--config FILE`` and per-field flags over it.

The core (:mod:`hicache.tiering.common.config`) reads files and mappings only; argparse lives here.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from typing import Any

from hicache.tiering.common.config import (
    HiCacheConfig,
    PrefetchConfig,
    StorageConfig,
    TierConfig,
    check_field,
    config_from_mapping,
    config_tables,
    load_config,
)
from hicache.tools.cli_parsing import arg_type, input_file, url_arg
from hicache.typed_config import build_config

__all__ = ["add_hicache_flags", "config_from_args", "l3_url"]

# CLI flag -> (table, field). Flags name their table only where a name would be ambiguous.
_FLAGS: dict[str, tuple[str, str, str]] = {
    "--write-policy": ("tiers", "write_policy", "write_through | write_through_selective | ..."),
    "--write-threshold": ("tiers", "write_threshold", "hits before write_through_selective"),
    "--host-pages": ("tiers", "host_pages", "host pages of the main pool"),
    "--host-ratio": ("tiers", "host_ratio", "host size as a multiple of the device pool"),
    "--host-layout": ("tiers", "host_layout", "page_first | page_first_direct | layer_first"),
    "--prefetch-policy": ("prefetch", "stop_policy", "best_effort | wait_complete | timeout"),
    "--prefetch-threshold": ("prefetch", "threshold_tokens", "min L3 tokens worth a prefetch"),
    "--prefetch-timeout-base": ("prefetch", "timeout_base_s", "seconds"),
    "--prefetch-timeout-per-1k": ("prefetch", "timeout_per_1k_tokens_s", "seconds per 1k"),
    "--prefetch-timeout-max": ("prefetch", "timeout_max_s", "seconds"),
    "--l3-admission": ("storage", "admission", "all | hit_threshold"),
    "--l3-hit-threshold": ("storage", "admission_hit_threshold", "hits before a page goes to L3"),
    "--l3-windows": ("storage", "window_admission", "reused | all: SWA windows written to L3"),
    "--l3-compress": ("storage", "compress", "zstd byte planes for L3 pages (true/false)"),
}


_TABLES: dict[str, type[Any]] = {
    "tiers": TierConfig,
    "prefetch": PrefetchConfig,
    "storage": StorageConfig,
}


def _number_type(table: str, name: str) -> Callable[[str], Any] | None:
    """For a numeric field, an argparse ``type=`` that reads and range-checks it as the config
    file would (so a bad value is a usage error); None for the others, which
    :func:`config_from_args` checks with the rest of the config."""
    hint = typing.get_type_hints(_TABLES[table])[name]
    if not {int, float} & set(typing.get_args(hint) or (hint,)):
        return None

    def read(text: str) -> Any:
        value = getattr(build_config(_TABLES[table], {name: text}), name)
        check_field(f"{table}.{name}", value)
        return text if value is None else value  # "none" stays text: None means "not given"

    convert = arg_type(read)
    convert.__name__ = "number"
    return convert


def l3_url(text: str) -> str:
    """An ``--l3`` value: a backend URL, checked, or none / off / empty (no L3)."""
    return text if text.strip().lower() in ("", "none", "off") else str(url_arg(text))


def add_hicache_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tiered cache")
    group.add_argument("--config", type=input_file, help="a .toml or .json HiCache config file")
    group.add_argument(
        "--l3", type=l3_url,
        help="L3 backend URL, or 'none' to turn L3 off (serve --http: also $HICACHE_L3_URL, "
        "which keeps credentials off the command line)",
    )  # fmt: skip
    group.add_argument("--l3-required", action="store_true", help="refuse to start without L3")
    group.add_argument("--no-host", action="store_true", help="no host tier (device only)")
    for flag, (table, name, help_text) in _FLAGS.items():
        number = _number_type(table, name)
        if number is None:  # an enum or a bool: checked with the rest of the config
            group.add_argument(flag, help=help_text)
        else:
            group.add_argument(flag, type=number, help=help_text)


def config_from_args(args: argparse.Namespace, base: HiCacheConfig | None = None) -> HiCacheConfig:
    """The config file named by ``--config`` (or ``base``), with the other flags over it."""
    config = load_config(args.config) if getattr(args, "config", None) else base or HiCacheConfig()
    tables = config_tables(config)
    for flag, (table, name, _) in _FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            tables[table][name] = value
    l3 = getattr(args, "l3", None)
    if l3 is not None:
        tables["storage"]["url"] = None if l3.strip().lower() in ("", "none", "off") else l3
    if getattr(args, "l3_required", False):
        tables["storage"]["required"] = True
    if getattr(args, "no_host", False):
        tables["tiers"]["host_enabled"] = False
    return config_from_mapping(tables)
