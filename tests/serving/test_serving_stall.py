"""A device node the tree declines to evict once must be evictable again later.

``HiRadixCache.evict_leaf`` keeps a node (returns 0) when it has host-only children and cannot
be backed up because the host tier is full of pages it may not evict (here: pages whose L3 write
is still in flight). Such a node used to be lost from the eviction heap: once the writes landed
it was an evictable leaf (counted in ``evictable_size``) that ``evict`` could no longer find, and
the serving engine waited forever for slots with nothing running.
"""

from __future__ import annotations

import pathlib

import torch
from serving_kit import model_config

from hicache.keys import RadixKey
from hicache.models.config import ModelPreset
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, StorageConfig, TierConfig
from hicache.tiering.common.policies import WritePolicy
from hicache.tiering.controller import HiCacheController


async def test_a_node_kept_once_is_evicted_once_the_host_has_room(tmp_path: pathlib.Path) -> None:
    spec = model_config(ModelPreset.DENSE).pools()
    device = device_pools(spec, {"kv": 64}, "cpu")
    host = host_pools(spec, {"kv": 6})
    config = HiCacheConfig(
        tiers=TierConfig(write_policy=WritePolicy.WRITE_BACK),
        storage=StorageConfig(url=f"file://{tmp_path / 'l3'}"),
    )
    controller = await HiCacheController.open(config, device, host)
    try:
        tree = HiRadixCache(controller, RadixCacheConfig(page_size=4))
        shared, one, two = list(range(16)), list(range(100, 108)), list(range(200, 208))
        slots = device["kv"].alloc(32)
        assert slots is not None
        tree.insert(RadixKey(shared + one), slots[:24])
        tree.insert(RadixKey(shared + two), torch.cat([slots[:16], slots[24:]]))
        # write_back: evicting the two leaves backs them up to host (4 of its 6 pages) and
        # queues their L3 writes, which protect those pages until they land.
        assert tree.evict(16) == 16
        assert controller.host_pools["kv"].protected_pages == 4
        # The shared node needs 4 host pages to be backed up; 2 are free, 4 are protected.
        assert tree.evict(16) == 0
        assert await controller.storage.drain(5.0)
        tree.check_events()  # the writes landed: the leaves' pages may be evicted now
        assert controller.host_pools["kv"].protected_pages == 0
        assert tree.evictable_size == 16
        assert tree.evict(16) == 16  # the kept node went back on the eviction heap
    finally:
        await controller.close()
