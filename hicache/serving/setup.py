"""Building an engine for a cache mode: pools, host tier, controller and tree."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.radix.tree import RadixCache, RadixCacheConfig
from hicache.serving.engine import CacheMode, Engine, EngineConfig
from hicache.serving.model import TinyTransformer
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.config import HiCacheConfig
from hicache.tiering.controller import HiCacheController

__all__ = ["ServingSetup", "host_pages", "open_engine", "resolve_device"]


@dataclass(slots=True)
class ServingSetup:
    engine: Engine
    cache: HiRadixCache | None  # the tiered cache, in the modes with host memory

    @property
    def controller(self) -> HiCacheController | None:
        return self.cache.controller if self.cache is not None else None

    async def l3_stats(self) -> dict[str, int | float]:
        """The L3 backend's own counters (``bytes_staged`` among them); empty without L3."""
        backend = self.cache.storage.backend if self.cache is not None else None
        return await backend.stats() if backend is not None else {}

    async def close(self, drain_s: float = 10.0) -> None:
        """Close the cache; L3 writes still queued get ``drain_s`` to land (a restart finds
        what was written)."""
        if self.cache is not None:
            await self.cache.close(drain_s)


def resolve_device(kind: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(kind)


def host_pages(hicache: HiCacheConfig, device_tokens: int, page_size: int) -> int:
    """Host pages of the anchor pool: ``tiers.host_pages``, else ``host_ratio`` x the device."""
    tiers = hicache.tiers
    return tiers.host_pages or max(1, int(device_tokens // page_size * tiers.host_ratio))


async def open_engine(
    model: TinyTransformer,
    mode: CacheMode,
    hicache: HiCacheConfig,
    device_tokens: int,
    engine_config: EngineConfig | None = None,
) -> ServingSetup:
    """An engine over fresh pools of ``device_tokens`` slots, caching as ``mode`` says.

    The host tier has ``tiers.host_pages`` pages, or ``host_ratio`` times the device pool.
    """
    config = model.config
    pools_spec = config.pools()
    anchor = pools_spec.names[0]
    device = device_pools(pools_spec, {anchor: device_tokens}, model.device)
    engine_config = engine_config or EngineConfig()
    radix = RadixCacheConfig(page_size=config.page_size)
    if mode is CacheMode.NONE:
        return ServingSetup(Engine(model, device, None, engine_config), None)
    if mode is CacheMode.DEVICE:
        tree = RadixCache(radix, device[anchor])
        return ServingSetup(Engine(model, device, tree, engine_config), None)
    pages = host_pages(hicache, device_tokens, config.page_size)
    host = host_pools(pools_spec, {anchor: pages}, hicache.tiers.host_layout)
    if mode is CacheMode.DEVICE_HOST:
        hicache = dataclasses.replace(
            hicache, storage=dataclasses.replace(hicache.storage, url=None)
        )
    tree = await HiRadixCache.open(hicache, device, host, radix)
    return ServingSetup(Engine(model, device, tree, engine_config), tree)
