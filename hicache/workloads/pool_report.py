"""Bytes each pool holds on every tier at the end of a run, and the state snapshots of a hybrid.

Device and host bytes are read from the pools' allocators (slots or pages in use, times their
size). L3 bytes come from a scan of the store, each object counted under the pool its key's
format digest names; a backend that cannot be scanned reports ``None`` for L3. A pool sharing
another's slots (the DSA indexer, the SSM state) counts its own bytes in its owner's slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hicache.errors import HiCacheError
from hicache.pools.device import DevicePool
from hicache.pools.pool_spec import Granularity

if TYPE_CHECKING:
    from hicache.tiering.cache import HiRadixCache

__all__ = ["pool_bytes", "state_snapshots"]


def _device_bytes(pool: DevicePool) -> int:
    return pool.used_size * pool.spec.page_bytes // pool.spec.page_size


async def _l3_usage(cache: HiRadixCache) -> dict[str, tuple[int, int]] | None:
    """Per pool, (stored bytes, objects) in L3; None without L3 or when it cannot be listed."""
    backend = cache.l3_backend
    if backend is None:
        return None
    by_digest = {fmt.digest: name for name, fmt in cache.page_formats.items()}
    out = dict.fromkeys(by_digest.values(), (0, 0))
    try:
        async for info in backend.scan():
            parts = info.key.split("-")
            name = by_digest.get(parts[1]) if len(parts) == 3 else None
            if name is not None:  # another model's or layout's objects are not ours to count
                nbytes, objects = out[name]
                out[name] = (nbytes + info.size, objects + 1)
    except (HiCacheError, NotImplementedError, OSError):
        return None
    return out


async def pool_bytes(
    device_pools: Mapping[str, DevicePool], cache: HiRadixCache | None
) -> dict[str, dict[str, int | None]]:
    """Per pool: ``device``, ``host`` and ``l3`` bytes held now (host/l3 None without them;
    L3 bytes as stored, page headers included), and ``l3_objects``."""
    l3 = await _l3_usage(cache) if cache is not None else None
    out: dict[str, dict[str, int | None]] = {}
    for name, pool in device_pools.items():
        host: int | None = None
        if cache is not None:
            host_pool = cache.host_pools[name]
            host = host_pool.used_pages * host_pool.spec.page_bytes
        out[name] = {
            "device": _device_bytes(pool),
            "host": host,
            "l3": None if l3 is None else l3.get(name, (0, 0))[0],
            "l3_objects": None if l3 is None else l3.get(name, (0, 0))[1],
        }
    return out


def state_snapshots(
    device_pools: Mapping[str, DevicePool], sizes: Mapping[str, Mapping[str, Any]]
) -> dict[str, int | None] | None:
    """Snapshots held per tier by the first per-sequence pool (from :func:`pool_bytes`' sizes:
    a request's working state counts on the device); None for a model without one."""
    for name, pool in device_pools.items():
        if pool.spec.granularity is Granularity.PER_SEQUENCE:
            per = pool.spec.page_bytes
            device, host = sizes[name]["device"], sizes[name]["host"]
            return {
                "device": device // per,
                "host": None if host is None else host // per,
                "l3": sizes[name]["l3_objects"],
            }
    return None
