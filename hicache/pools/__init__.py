"""Memory pools: pool specs and presets, device and host pools, slot allocators, the
request-to-token table."""

from hicache.pools.allocator import TokenSlotAllocator
from hicache.pools.device import (
    DevicePool,
    default_device,
    device_pools,
    pack_indexer,
    unpack_indexer,
)
from hicache.pools.host import HostPool, host_pools
from hicache.pools.pool_spec import (
    ALL_PAGES,
    STATE_AT_END,
    Granularity,
    HitRule,
    HitRuleKind,
    ModelPools,
    PoolSpec,
    common_usable_prefix,
    usable_ends,
    usable_prefix,
    validate_pool_name,
)
from hicache.pools.presets import ModelPreset, ModelShape, PoolPreset, preset
from hicache.pools.req_to_token import ReqToTokenPool

__all__ = [
    "ALL_PAGES",
    "STATE_AT_END",
    "DevicePool",
    "Granularity",
    "HitRule",
    "HitRuleKind",
    "HostPool",
    "ModelPools",
    "ModelPreset",
    "ModelShape",
    "PoolPreset",
    "PoolSpec",
    "ReqToTokenPool",
    "TokenSlotAllocator",
    "common_usable_prefix",
    "default_device",
    "device_pools",
    "host_pools",
    "pack_indexer",
    "preset",
    "unpack_indexer",
    "usable_ends",
    "usable_prefix",
    "validate_pool_name",
]
