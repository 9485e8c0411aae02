"""HiCache configuration: frozen dataclasses, read from TOML or JSON files and from CLI flags.

A file has up to four tables; every key is optional::

    [tiers]                      # write policy and the host tier
    write_policy = "write_through_selective"
    host_ratio = 2.0

    [prefetch]
    stop_policy = "timeout"
    threshold_tokens = 256

    [storage]                    # L3
    url = "file:///var/cache/hicache"
    required = false

CLI flags (``hicache.tools.config_flags``) override the file. :func:`check_config` refuses a
combination that cannot work, with a message saying what to change; it runs before anything
is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache.errors import BackendError, ConfigError
from hicache.layouts import Layout
from hicache.tiering.common.policies import (
    L3Admission,
    PrefetchStopPolicy,
    WindowAdmission,
    WritePolicy,
)
from hicache.typed_config import build_config

__all__ = [
    "HiCacheConfig",
    "PrefetchConfig",
    "StorageConfig",
    "TierConfig",
    "FIELD_RANGES",
    "check_config",
    "check_field",
    "check_storage_url",
    "config_from_mapping",
    "config_tables",
    "load_config",
]


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Device-to-host behaviour and the host tier's size."""

    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_threshold: int = 2  # write_through_selective: hits before a node is backed up
    host_enabled: bool = True
    host_pages: int | None = None  # host pages of the anchor pool; None: host_ratio x device
    host_ratio: float = 2.0
    host_layout: Layout = Layout.PAGE_FIRST
    load_back_threshold_tokens: int = 0  # a shorter host hit is recomputed, not loaded


@dataclass(frozen=True, slots=True)
class PrefetchConfig:
    """L3-to-host prefetch: when it starts and when its request stops waiting for it."""

    enabled: bool = True
    stop_policy: PrefetchStopPolicy = PrefetchStopPolicy.TIMEOUT
    threshold_tokens: int = 256  # a shorter L3 candidate is not prefetched
    timeout_base_s: float = 2.0
    timeout_per_1k_tokens_s: float = 0.1
    timeout_max_s: float = 30.0
    capacity_share: float = 0.5  # at most this share of host pages held by running prefetches
    # Pages read per backend call (one acknowledgement per batch); also the first lookup batch
    batch_pages: int = 32
    # Prefetches talking to L3 at once; the rest wait their turn in the order they started, so
    # under a burst the first requests' reads finish first instead of all finishing last.
    concurrency: int = 4


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """The L3 tier: a backend URL and how pages go to it."""

    url: str | None = None  # None: no L3
    required: bool = False  # refuse to start when L3 is unreachable (else start with L3 off)
    admission: L3Admission = L3Admission.ALL
    admission_hit_threshold: int = 2
    # A window pool's windows (SWA): a request leaves one at each of its ends, and one that no
    # later request extends costs about its own tokens again; REUSED stores those reused.
    window_admission: WindowAdmission = WindowAdmission.REUSED
    write_batch_pages: int = 32
    write_queue_pages: int = 4096  # pages waiting for L3; past it the least valuable is dropped
    op_deadline_s: float = 30.0  # one backend call; past it the call counts as failed
    compress: bool = False
    model_id: str = "hicache-model"  # part of every key: another model's pages never match
    shard: str = "tp0of1"
    backend_in_thread: bool = False  # run the backend on its own event loop thread
    workers: int = 2  # concurrent L3 write batches
    # Before a write skips pages L3 holds, read them back and check them: the engine computed
    # them, so nothing read them, and a damaged copy would stay a miss until `compact`.
    check_present: bool = True
    # The namespaces are scratch (a model id no later run names): the pages this cache wrote
    # are deleted from L3 when it closes, not left for nobody (HiRadixCache.close).
    discard_on_close: bool = False


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    tiers: TierConfig = field(default_factory=TierConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def with_changes(self, section: str, **changes: Any) -> HiCacheConfig:
        current = getattr(self, section)
        return dataclasses.replace(self, **{section: dataclasses.replace(current, **changes)})


_SECTIONS: dict[str, type[Any]] = {
    "tiers": TierConfig,
    "prefetch": PrefetchConfig,
    "storage": StorageConfig,
}


def config_from_mapping(data: Mapping[str, Any]) -> HiCacheConfig:
    """A config from nested tables (as a TOML or JSON file holds them)."""
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config table(s) {unknown}; known: {sorted(_SECTIONS)}")
    parts = {}
    for name, cls in _SECTIONS.items():
        table = data.get(name, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{name}] must be a table of options")
        parts[name] = build_config(cls, dict(table))
    return HiCacheConfig(**parts)


def load_config(path: str | pathlib.Path) -> HiCacheConfig:
    """Read a ``.toml`` or ``.json`` file; a bad file names itself and what is wrong."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = _toml_loads(text)
        else:
            raise ConfigError(f"config file {path} must end in .toml or .json")
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table at its top level")
    return config_from_mapping(data)


def _toml_loads(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


# Each number's range: (low, high, low excluded). Every number must also be finite. The upper
# bounds are generous; they stop a typo from allocating (host pages, workers, batch pages) or
# waiting (timeouts) without end.
_DAY_S = 86400.0
FIELD_RANGES: dict[str, tuple[float, float, bool]] = {
    "tiers.write_threshold": (0, 1 << 20, True),
    "tiers.host_pages": (0, 1 << 30, True),
    "tiers.host_ratio": (0.0, 1000.0, True),
    "tiers.load_back_threshold_tokens": (0, 1 << 30, False),
    "prefetch.threshold_tokens": (0, 1 << 30, False),
    "prefetch.timeout_base_s": (0.0, _DAY_S, False),
    "prefetch.timeout_per_1k_tokens_s": (0.0, _DAY_S, False),
    "prefetch.timeout_max_s": (0.0, _DAY_S, False),
    "prefetch.capacity_share": (0.0, 1.0, True),
    "prefetch.batch_pages": (0, 4096, True),
    "prefetch.concurrency": (0, 1024, True),
    "storage.admission_hit_threshold": (0, 1 << 20, True),
    "storage.write_batch_pages": (0, 4096, True),
    "storage.write_queue_pages": (0, 1 << 24, True),
    "storage.op_deadline_s": (0.0, _DAY_S, True),
    "storage.workers": (0, 256, True),
}


def check_field(name: str, value: Any) -> None:
    """Refuse a value of field ``name`` ("table.field") outside its range, or not finite."""
    if value is None or name not in FIELD_RANGES:
        return
    low, high, low_open = FIELD_RANGES[name]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if low_open and low == 0 and value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if value < low:
        raise ConfigError(f"{name} must be at least {low}, got {value}")
    if value > high:
        if name == "prefetch.capacity_share":
            raise ConfigError(f"{name} must be in (0, 1], got {value}")
        raise ConfigError(f"{name} must be at most {high:g}, got {value}")


def check_config(config: HiCacheConfig, page_size: int) -> None:
    """Refuse values out of range and combinations that cannot work, saying what to change."""
    for table in _SECTIONS:
        section = getattr(config, table)
        for f in dataclasses.fields(section):
            check_field(f"{table}.{f.name}", getattr(section, f.name))
    tiers, prefetch, storage = config.tiers, config.prefetch, config.storage
    if tiers.write_policy is WritePolicy.WRITE_BACK and not tiers.host_enabled:
        raise ConfigError(
            "write_policy write_back backs pages up to host memory when the device evicts them; "
            "enable the host tier or use write_through"
        )
    if storage.url is not None and not tiers.host_enabled:
        raise ConfigError("an L3 tier moves pages through host memory; enable the host tier")
    if prefetch.threshold_tokens < page_size:
        raise ConfigError(
            f"prefetch threshold_tokens {prefetch.threshold_tokens} is below the page size "
            f"{page_size}; set it to at least {page_size}"
        )
    _check_names(storage)
    if storage.url is not None:
        check_storage_url(storage.url)


def _check_names(storage: StorageConfig) -> None:
    """``model_id`` and ``shard`` go into every L3 key: refuse what a key cannot carry."""
    from hicache.dtypes import DType
    from hicache.errors import InvalidArgumentError
    from hicache.keys import StorageFormat

    try:
        storage.model_id.encode("utf-8")
        StorageFormat(storage.model_id, DType.UINT8, Layout.PAGE_FIRST, 1, shard=storage.shard)
    except (InvalidArgumentError, UnicodeError) as exc:
        raise ConfigError(f"storage model_id/shard: {exc}") from None


def check_storage_url(url: str) -> None:
    """Refuse an L3 URL no installed backend serves, listing what is available."""
    from hicache.backends.registry import default_registry
    from hicache.urls import redact_url, scrub

    if "\x00" in url or "%00" in url:
        raise ConfigError(f"storage url {redact_url(url)!r} holds a NUL byte")
    try:
        default_registry.resolve_url(url)
    except (BackendError, ValueError) as exc:
        raise ConfigError(scrub(f"storage url {url!r}: {exc}", url)) from None


def config_tables(config: HiCacheConfig) -> dict[str, dict[str, Any]]:
    """``config`` as nested tables, the shape :func:`config_from_mapping` reads."""
    return {
        name: {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        for name, section in ((n, getattr(config, n)) for n in _SECTIONS)
    }
