"""hicache backends as SGLang's ``dynamic`` HiCache storage backend.

Load with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name":"hicache","module_path":"hicache.integrations.sglang",
        "class_name":"SGLangStorage","url":"file:///var/cache/kv","interface_v1":1}'

``url`` is any hicache backend URL (``file://``, ``mooncake://``, ``s3://`` through fsspec,
``shm://``, a plugin's scheme). ``io_timeout_s`` (default 60) bounds one storage call; a call
that takes longer is a miss or a failed write. SGLang's factory builds the class with
``cls(storage_config, kwargs)`` and registers its host pools; its threads then call the methods
below. With ``interface_v1`` the controller uses the zero-copy ``batch_get_v1`` /
``batch_set_v1``; without it, the generic ``batch_get`` / ``batch_set`` with flat page copies.
Both store the same objects, so either reads what the other wrote.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.backends.registry import open_backend
from hicache.errors import ConfigError, HiCacheError
from hicache.integrations.sglang.hits import HitPolicy, PoolQuery, restorable_prefix
from hicache.integrations.sglang.page_io import PageIo
from hicache.integrations.sglang.pools import PoolBinding, ShardIdentity
from hicache.integrations.sync_loop import SyncLoop
from hicache.typed_config import build_config

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - only without SGLang installed
    raise ImportError(
        "hicache.integrations.sglang needs SGLang (pip install sglang); "
        f"importing its HiCache storage API failed: {exc}"
    ) from exc

__all__ = ["AdapterConfig", "SGLangStorage", "extra_config"]

# The path SGLang's config names: the package, which exports SGLangStorage.
MODULE_PATH = "hicache.integrations.sglang"
log = logging.getLogger(MODULE_PATH)
KV_POOL = "kv"
# Keys of the extra config that SGLang's dynamic loader reads itself.
_LOADER_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


def extra_config(url: str, **options: Any) -> dict[str, Any]:
    """SGLang's ``--hicache-storage-backend-extra-config`` that loads this adapter on ``url``
    (zero-copy interface), plus ``options`` (``io_timeout_s``, or SGLang's own keys)."""
    return {
        "backend_name": "hicache",
        "module_path": MODULE_PATH,
        "class_name": SGLangStorage.__name__,
        "url": url,
        "interface_v1": 1,
        **options,
    }


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """The adapter's own keys of ``--hicache-storage-backend-extra-config``."""

    url: str
    io_timeout_s: float = 60.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> AdapterConfig:
        extra = dict(extra or {})
        if not extra.get("url"):
            raise ConfigError(
                'hicache SGLang storage: the extra config needs "url", a hicache backend '
                "URL such as file:///var/cache/kv or mooncake://host:port"
            )
        ours = {k: v for k, v in extra.items() if k in ("url", "io_timeout_s")}
        ignored = sorted(set(extra) - set(ours) - _LOADER_KEYS)
        if ignored:
            log.warning("hicache SGLang storage ignores extra-config keys %s", ignored)
        config = build_config(cls, ours)
        if not config.io_timeout_s > 0:
            raise ConfigError(f"io_timeout_s must be positive, got {config.io_timeout_s}")
        return config


class SGLangStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang ``HiCacheStorage`` over any hicache backend, namespaced per model and shard."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        self.config = AdapterConfig.from_extra_config(storage_config.extra_config)
        self.shard = ShardIdentity.from_storage_config(storage_config)
        self.pools: dict[str, PoolBinding] = {}
        scheme = self.config.url.partition("://")[0]
        self._loop = SyncLoop(f"hicache-sglang-{scheme}")
        try:
            backend = self._loop.run(open_backend(self.config.url), self.config.io_timeout_s)
        except HiCacheError as exc:
            self._loop.close()
            raise ConfigError(
                f"hicache SGLang storage cannot open {self.config.url}: {exc}"
            ) from exc
        except BaseException:
            self._loop.close()
            raise
        self._loop.on_close(backend.close)
        self.io = PageIo(backend, self._loop, self.config.io_timeout_s)

    # ----- pools ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._bind(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._bind(host_pool_name, host_pool)

    def _bind(self, name: Any, host_pool: Any) -> None:
        binding = PoolBinding(name, host_pool, self.shard)
        self.pools[binding.name] = binding
        self.io.register_pool_memory(binding)

    def _pool(self, name: Any) -> PoolBinding | None:
        binding = self.pools.get(str(getattr(name, "value", name)))
        if binding is None:
            log.warning("hicache: no host pool registered under %r", name)
        return binding

    # ----- the KV pool: zero-copy (interface_v1) ---------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        kv = self._pool(KV_POOL)
        return self.io.leading_hits(kv, keys) if kv is not None else 0

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        return self._move(KV_POOL, keys, host_indices, reading=True)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        return self._move(KV_POOL, keys, host_indices, reading=False)

    def _move(self, pool: Any, keys: list[str], host_indices: Any, reading: bool) -> list[bool]:
        """Pages between the store and a pool's token slots (page i at host_indices[i * ps])."""
        binding = self._pool(pool)
        slots = _page_slots(binding, keys, host_indices)
        if binding is None or slots is None:
            return [False] * len(keys)
        if reading:
            return self.io.read(binding, keys, slots)
        return self.io.write(binding, keys, [binding.page_view(slot) for slot in slots])

    # ----- the KV pool: the generic path (flat page copies made by SGLang) --------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        kv = self._pool(KV_POOL)
        targets = list(target_locations or [None] * len(keys))
        if kv is None or len(targets) != len(keys) or any(t is None for t in targets):
            return [None] * len(keys)
        ok = self.io.read_flat(kv, keys, targets)
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        kv = self._pool(KV_POOL)
        if kv is None or values is None or len(values) != len(keys):
            return False
        return all(self.io.write(kv, keys, list(values)))

    # ----- side pools (v2) ------------------------------------------------------------------
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        kv = self._pool(KV_POOL)
        if kv is None:
            return PoolTransferResult.empty()
        queries = []
        for transfer in pool_transfers or []:
            binding = self._pool(transfer.name)
            present = self.io.present(binding, keys) if binding else [False] * len(keys)
            window = len(transfer.keys) if transfer.keys else 1
            policy = HitPolicy(str(getattr(transfer.hit_policy, "value", transfer.hit_policy)))
            queries.append(PoolQuery(str(transfer.name), policy, present, window))
        verdict = restorable_prefix(KV_POOL, self.io.present(kv, keys), queries)
        return PoolTransferResult(verdict.kv_pages, dict(verdict.hits), verdict.restorable)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer(t, reading=True) for t in transfers}

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer(t, reading=False) for t in transfers}

    def _transfer(self, transfer: Any, reading: bool) -> list[bool]:
        return self._move(transfer.name, list(transfer.keys or []), transfer.host_indices, reading)

    # ----- lifecycle ------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this instance's pages (its model, shard and pools); other namespaces stay."""
        for binding in list(self.pools.values()):
            try:
                self._loop.run(self.io.delete_prefix(binding.prefix), self.config.io_timeout_s)
            except HiCacheError as exc:
                log.warning("hicache: clearing pool %s failed: %s", binding.name, exc)

    def close(self) -> None:
        """Close the backend (writes in flight finish first) and stop the loop. Idempotent."""
        self._loop.close()

    def backend_stats(self) -> dict[str, int | float]:
        """The hicache backend's own counters (bytes read and written, staged, misses)."""
        return dict(self._loop.run(self.io.backend.stats(), self.config.io_timeout_s))

    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        prefetch_pgs, backup_pgs, prefetch_bw, backup_bw = self.io.stats.drain()
        metrics.prefetch_pgs.extend(prefetch_pgs)
        metrics.backup_pgs.extend(backup_pgs)
        metrics.prefetch_bandwidth.extend(prefetch_bw)
        metrics.backup_bandwidth.extend(backup_bw)
        return metrics


def _page_slots(pool: PoolBinding | None, keys: list[str], host_indices: Any) -> list[int] | None:
    """The token slot each page starts at (page i at ``host_indices[i * page_size]``)."""
    if pool is None or host_indices is None:
        return None
    flat = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
    if len(flat) < len(keys) * pool.page_size:
        log.warning(
            "hicache: %d host slots for %d pages of %d tokens", len(flat), len(keys), pool.page_size
        )
        return None
    return [int(flat[i * pool.page_size]) for i in range(len(keys))]
