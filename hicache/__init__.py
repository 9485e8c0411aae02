"""hicache: a hierarchical KV cache (device, host, storage) with pluggable storage backends.

Everything a user needs is importable from here::

    import hicache

    store = await hicache.open_backend("file:///var/cache/hicache")
    cache = await hicache.HiRadixCache.open(hicache.HiCacheConfig(), device, host)

Names are imported on first use (PEP 562), so ``import hicache`` costs nothing and the store
tools, which never touch tensors, do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy_exports import lazy_getattr

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # page identity and page format
    "RadixKey": "hicache.keys",
    "PageKeyScheme": "hicache.keys",
    "StorageFormat": "hicache.keys",
    "namespace_digest": "hicache.keys",
    "storage_key": "hicache.keys",
    "PageMeta": "hicache.codec",
    "encode_page": "hicache.codec",
    "decode_page": "hicache.codec",
    "DType": "hicache.dtypes",
    "Layout": "hicache.dtypes",
    # the radix tree
    "RadixCache": "hicache.radix.tree",
    "RadixCacheConfig": "hicache.radix.tree",
    "MatchResult": "hicache.radix.tree",
    "EvictionPolicy": "hicache.radix.eviction",
    "CachedRequest": "hicache.radix.lifecycle",
    "ShadowRadixCache": "hicache.radix.shadow",
    # pools
    "PoolSpec": "hicache.pools.pool_spec",
    "PoolPreset": "hicache.pools.presets",
    "ModelShape": "hicache.pools.presets",
    "preset": "hicache.pools.presets",
    "DevicePool": "hicache.pools.device",
    "device_pools": "hicache.pools.device",
    "HostPool": "hicache.pools.host",
    "host_pools": "hicache.pools.host",
    "ReqToTokenPool": "hicache.pools.req_to_token",
    # the tiered cache and its config
    "HiRadixCache": "hicache.tiering.cache",
    "HiCacheConfig": "hicache.tiering.common.config",
    "TierConfig": "hicache.tiering.common.config",
    "PrefetchConfig": "hicache.tiering.common.config",
    "StorageConfig": "hicache.tiering.common.config",
    "load_config": "hicache.tiering.common.config",
    "WritePolicy": "hicache.tiering.common.policies",
    "PrefetchStopPolicy": "hicache.tiering.common.policies",
    "L3Admission": "hicache.tiering.common.policies",
    "HiCacheMetrics": "hicache.tiering.common.metrics",
    # storage backends
    "StorageBackend": "hicache.backends.base",
    "Capabilities": "hicache.backends.base",
    "open_backend": "hicache.backends.registry",
    "register_backend": "hicache.backends.registry",
    "list_backends": "hicache.backends.registry",
    # errors
    "HiCacheError": "hicache.errors",
    "ConfigError": "hicache.errors",
    "InvalidArgumentError": "hicache.errors",
    "InvalidKeyError": "hicache.errors",
    "BackendError": "hicache.errors",
    "BackendUnavailableError": "hicache.errors",
    "BackendNotFoundError": "hicache.errors",
    "ReadOnlyStoreError": "hicache.errors",
    "CodecError": "hicache.errors",
}

__all__ = [
    "BackendError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CachedRequest",
    "Capabilities",
    "CodecError",
    "ConfigError",
    "DType",
    "DevicePool",
    "EvictionPolicy",
    "HiCacheConfig",
    "HiCacheError",
    "HiCacheMetrics",
    "HiRadixCache",
    "HostPool",
    "InvalidArgumentError",
    "InvalidKeyError",
    "L3Admission",
    "Layout",
    "MatchResult",
    "ModelShape",
    "PageKeyScheme",
    "PageMeta",
    "PoolPreset",
    "PoolSpec",
    "PrefetchConfig",
    "PrefetchStopPolicy",
    "RadixCache",
    "RadixCacheConfig",
    "RadixKey",
    "ReadOnlyStoreError",
    "ReqToTokenPool",
    "ShadowRadixCache",
    "StorageBackend",
    "StorageConfig",
    "StorageFormat",
    "TierConfig",
    "WritePolicy",
    "decode_page",
    "device_pools",
    "encode_page",
    "host_pools",
    "list_backends",
    "load_config",
    "namespace_digest",
    "open_backend",
    "preset",
    "register_backend",
    "storage_key",
]


__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from hicache.backends.base import Capabilities, StorageBackend
    from hicache.backends.registry import list_backends, open_backend, register_backend
    from hicache.codec import PageMeta, decode_page, encode_page
    from hicache.dtypes import DType, Layout
    from hicache.errors import (
        BackendError,
        BackendNotFoundError,
        BackendUnavailableError,
        CodecError,
        ConfigError,
        HiCacheError,
        InvalidArgumentError,
        InvalidKeyError,
        ReadOnlyStoreError,
    )
    from hicache.keys import PageKeyScheme, RadixKey, StorageFormat, namespace_digest, storage_key
    from hicache.pools.device import DevicePool, device_pools
    from hicache.pools.host import HostPool, host_pools
    from hicache.pools.pool_spec import PoolSpec
    from hicache.pools.presets import ModelShape, PoolPreset, preset
    from hicache.pools.req_to_token import ReqToTokenPool
    from hicache.radix.eviction import EvictionPolicy
    from hicache.radix.lifecycle import CachedRequest
    from hicache.radix.shadow import ShadowRadixCache
    from hicache.radix.tree import MatchResult, RadixCache, RadixCacheConfig
    from hicache.tiering.cache import HiRadixCache
    from hicache.tiering.common.config import (
        HiCacheConfig,
        PrefetchConfig,
        StorageConfig,
        TierConfig,
        load_config,
    )
    from hicache.tiering.common.metrics import HiCacheMetrics
    from hicache.tiering.common.policies import L3Admission, PrefetchStopPolicy, WritePolicy
