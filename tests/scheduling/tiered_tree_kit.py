"""A real tiered tree for the scheduling tests: prefixes cached on the device, or evicted to host.

Nothing runs a model here: the tests order requests by what the tree holds where, so only the
tree's own bookkeeping (slots, host pages, the hit rules) matters, not the KV in the slots.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from hicache.keys import RadixKey
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, TierConfig
from hicache.tiering.common.policies import WritePolicy
from hicache.tiering.controller import HiCacheController

PAGE = 4


async def open_tiered(device_tokens: int = 256, host_pages: int = 128) -> HiRadixCache:
    """A write-through tiered tree over a dense model's pools (no L3); close it with
    ``await tree.close()``."""
    model = preset(PoolPreset.DENSE, ModelShape(page_size=PAGE))
    device = device_pools(model, {"kv": device_tokens}, "cpu")
    host = host_pools(model, {"kv": host_pages})
    config = HiCacheConfig(TierConfig(write_policy=WritePolicy.WRITE_THROUGH))
    controller = await HiCacheController.open(config, device, host)
    return HiRadixCache(controller, RadixCacheConfig(page_size=PAGE))


@contextlib.asynccontextmanager
async def tiered_with(
    on_host: Sequence[Sequence[int]], on_device: Sequence[Sequence[int]]
) -> AsyncIterator[HiRadixCache]:
    """A tiered tree holding ``on_host`` on host only and ``on_device`` on the device (whole
    pages of each), as a server's tree is after the device evicted the first ones."""
    tree = await open_tiered()
    try:
        for tokens in on_host:
            cache(tree, tokens)
        await tree.quiesce()  # write-through: every page backed up to host
        tree.evict(tree.evictable_size)  # every page to host
        for tokens in on_device:
            cache(tree, tokens)  # on the device (again, where it was on host)
        await tree.quiesce()
        yield tree
    finally:
        await tree.close()


def cache(tree: HiRadixCache, tokens: Sequence[int]) -> None:
    """Insert ``tokens``'s whole pages with fresh device slots, freeing those it already held."""
    n = len(tokens) - len(tokens) % PAGE
    slots = tree.device.alloc(n)
    assert slots is not None, "the device pool is full"
    already = tree.insert(RadixKey(list(tokens[:n])), slots)
    if already:
        tree.device.free(slots[:already])
