"""Building an engine for a cache mode: pools, host tier, controller and tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hicache.errors import ConfigError
from hicache.models.config import ModelConfig
from hicache.models.types import ServingModel
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.radix.shadow import ShadowRadixCache
from hicache.radix.tree import RadixCacheConfig
from hicache.serving.engine import CacheMode, Engine, EngineConfig
from hicache.serving.hisparse import HiSparseRequests
from hicache.serving.pool_slots import swa_reserve
from hicache.sparse.hot_buffer import HotBuffer
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig

__all__ = [
    "ServingSetup",
    "device_slots",
    "host_page_counts",
    "host_pages",
    "open_engine",
    "resolve_device",
]


@dataclass(slots=True)
class ServingSetup:
    engine: Engine
    cache: HiRadixCache | None  # the tiered cache, in the modes with host memory

    async def l3_stats(self) -> dict[str, int | float]:
        """The L3 backend's own counters (``bytes_staged`` among them); empty without L3."""
        backend = self.cache.l3_backend if self.cache is not None else None
        return await backend.stats() if backend is not None else {}

    async def close(self, drain_s: float = 10.0) -> None:
        """Close the cache; L3 writes still queued get ``drain_s`` to land (a restart finds
        what was written); HiSparse's copier stops."""
        if self.engine.sparse is not None:
            self.engine.sparse.close()
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


def device_slots(
    config: ModelConfig, device_tokens: int, engine: EngineConfig, tree: bool = True
) -> dict[str, int]:
    """Device slots of each slot-owning pool of ``config``'s model.

    * the anchor (``kv`` / ``latent``, with the DSA indexer on its slots): ``device_tokens``;
    * ``swa`` (own slots, the window layers): the reservations of ``max_running`` requests
      (:func:`~hicache.serving.pool_slots.swa_reserve`: the window, a chunk and a page of their
      own, plus the tree window their lock pins, with ``chunk = min(chunk_tokens,
      device_tokens)``) and room for the windows the tree keeps: an eighth of the anchor's
      tokens, four windows per running request or half the reservations, whichever is most
      (a window pool much smaller than that loses windows, and so hits, long before the
      anchor loses the prefixes they end);
    * another per-token pool (dsv4's ``c128``, which holds every token): ``device_tokens``;
    * ``conv`` (snapshots; ``ssm`` on the same slots): a working slot per running request, a
      snapshot every ``state_interval`` tokens of the anchor pool, and a few per request for its
      prompt end, its final end and a locked hit: ``max_running + device_tokens //
      state_interval + 4 * max_running``.
    """
    spec = config.pools()
    ps, running = config.page_size, engine.max_running
    slots = {spec.names[0]: device_tokens}
    for pool in spec:
        if pool.shares_slots_with is not None or pool.name in slots:
            continue
        if pool.name == "swa":
            chunk = min(engine.chunk_tokens, device_tokens)
            one = swa_reserve(config.window, chunk, ps, tree)
            room = max(device_tokens // 8, 4 * running * config.window, running * one // 2)
            room = room if tree else 0
            slots["swa"] = -(-(running * one + room) // ps) * ps
        elif pool.name == "conv":
            slots["conv"] = running + device_tokens // config.state_interval + 4 * running
        else:
            slots[pool.name] = device_tokens
    return slots


def host_page_counts(config: ModelConfig, slots: dict[str, int], pages: int) -> dict[str, int]:
    """Host pages of each slot-owning pool: ``pages`` for the anchor; an extra pool as many as
    the anchor's host tier holds in the proportion the device pools have (an SWA pool's share
    of the anchor's tokens; for the snapshot pool, a snapshot per ``state_interval`` tokens of
    the anchor's host pages plus its device count), so host holds what device eviction sends
    it."""
    anchor = config.pools().names[0]
    tokens = pages * config.page_size
    counts = {anchor: pages}
    for name, size in slots.items():
        if name == anchor:
            continue
        if name == "conv":
            counts[name] = tokens // config.state_interval + size
        else:  # a per-token pool: pages in the device pools' proportion, one window at least
            share = -(-tokens * size // slots[anchor]) // config.page_size
            counts[name] = max(share, -(-config.window // config.page_size))
    return counts


async def open_engine(
    model: ServingModel,
    mode: CacheMode,
    hicache: HiCacheConfig,
    device_tokens: int,
    engine_config: EngineConfig | None = None,
) -> ServingSetup:
    """An engine over fresh pools (``device_tokens`` slots for the anchor, the others as
    :func:`device_slots` says), caching as ``mode`` says: none, a
    :class:`~hicache.radix.shadow.ShadowRadixCache` over the device pools, or the tiered cache.

    The host tier has ``tiers.host_pages`` pages, or ``host_ratio`` times the device pool.
    """
    config = model.config
    pools_spec = config.pools()
    engine_config = engine_config or EngineConfig()
    if engine_config.hisparse is not None:
        engine_config.hisparse.check(config, device_tokens)
        if mode in (CacheMode.NONE, CacheMode.DEVICE):
            raise ConfigError(
                f"--hisparse needs a host tier (cache device+host or device+host+l3), not "
                f"{mode.value!r}: the decoding requests' latent lives in host memory"
            )
    sizes = device_slots(config, device_tokens, engine_config, mode is not CacheMode.NONE)
    device = device_pools(pools_spec, sizes, model.device)
    radix = RadixCacheConfig(page_size=config.page_size, policy=engine_config.eviction)
    if mode is CacheMode.NONE:
        return ServingSetup(Engine(model, device, None, engine_config), None)
    if mode is CacheMode.DEVICE:
        owners = {
            p.name: device[p.name].allocator for p in pools_spec if p.shares_slots_with is None
        }
        shadow = ShadowRadixCache(pools_spec, owners, radix)
        return ServingSetup(Engine(model, device, shadow, engine_config), None)
    pages = host_pages(hicache, device_tokens, config.page_size)
    counts = host_page_counts(config, sizes, pages)
    host = host_pools(pools_spec, counts, hicache.tiers.host_layout)
    if mode is CacheMode.DEVICE_HOST:
        hicache = hicache.with_changes("storage", url=None)
    tree = await HiRadixCache.open(hicache, device, host, radix)
    engine = Engine(model, device, tree, engine_config)
    if engine_config.hisparse is not None:
        sparse = hisparse_requests(config, engine, tree, device_tokens, device)
        engine.use_hisparse(sparse)
    return ServingSetup(engine, tree)


def hisparse_requests(
    model: ModelConfig,
    engine: Engine,
    tree: HiRadixCache,
    device_tokens: int,
    pools: dict[str, Any],
) -> HiSparseRequests:
    """A hot buffer of ``engine``'s ``max_running`` rows over the tree's host pool of the
    anchor (see :class:`~hicache.sparse.hot_buffer.HiSparseConfig`)."""
    config = engine.config.hisparse
    assert config is not None
    rows = engine.config.max_running
    ps = tree.page_size
    index_tokens = config.index_tokens or rows * device_tokens
    index_tokens = -(-index_tokens // ps) * ps
    anchor = pools[tree.roles.anchor]
    buffer = HotBuffer(
        model, config, rows, index_tokens, tree.host, anchor.device, context_tokens=device_tokens
    )
    return HiSparseRequests(buffer, tree, pools, engine.pool_slots)
