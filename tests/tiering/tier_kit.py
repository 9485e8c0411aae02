"""A small engine stand-in for tiering tests: pools, controller, tree and fake KV.

The "model" writes KV that is a pure function of (token, position), so any slot the tree hands
back can be checked against what a recompute would have written: a wrong page is caught by
``check_prefix``, whichever tier it came through.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from clock_kit import FakeClock

from hicache.backends.base import StorageBackend
from hicache.keys import RadixKey
from hicache.pools.device import DevicePool, device_pools
from hicache.pools.host import HostPool, host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.pools.req_to_token import ReqToTokenPool
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig, TierConfig
from hicache.tiering.controller import HiCacheController

PAGE = 4


def fake_kv(tokens: Sequence[int], start: int, shape: tuple[int, ...]) -> torch.Tensor:
    """What the stand-in model computes for ``tokens`` at positions ``start...``."""
    tok = torch.tensor(list(tokens), dtype=torch.float32)
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)
    base = (tok * 0.001 + pos * 0.01) % 7.0
    return base.reshape(-1, *([1] * len(shape))).expand(-1, *shape).clone()


# The tiered cache's tests start their clocks here, well past 0.
CLOCK_START = 1000.0


@dataclasses.dataclass
class Harness:
    controller: HiCacheController
    tree: HiRadixCache
    device: dict[str, DevicePool]
    host: dict[str, HostPool]
    clock: FakeClock

    @property
    def kv(self) -> DevicePool:
        return self.device[self.controller.anchor]

    # ----- building ---------------------------------------------------------------------------
    @classmethod
    async def build(
        cls,
        *,
        url: str | None = None,
        device_tokens: int = 128,
        host_pages: int = 64,
        tiers: TierConfig | None = None,
        prefetch: PrefetchConfig | None = None,
        storage: StorageConfig | None = None,
        pool_preset: PoolPreset = PoolPreset.DENSE,
        backend: StorageBackend | None = None,
        device_kind: str = "cpu",
    ) -> Harness:
        """A tree over tiny pools. ``backend``: an already open backend used as L3 instead of
        opening ``url`` (for wrapped backends)."""
        model = preset(pool_preset, ModelShape(page_size=PAGE))
        owners = [s.name for s in model if s.shares_slots_with is None]
        device = device_pools(model, {owners[0]: device_tokens}, device_kind)
        host = host_pools(model, {owners[0]: host_pages})
        storage = storage or StorageConfig()
        if url is not None:
            storage = dataclasses.replace(storage, url=url)
        config = HiCacheConfig(
            tiers or TierConfig(),
            prefetch or PrefetchConfig(threshold_tokens=PAGE, timeout_base_s=1.0),
            storage,
        )
        controller = await HiCacheController.open(config, device, host)
        if backend is not None:
            controller.storage.start(backend)
        clock = FakeClock(CLOCK_START)
        tree = HiRadixCache(
            controller, RadixCacheConfig(page_size=PAGE), ReqToTokenPool(16, device_tokens), clock
        )
        return cls(controller, tree, device, host, clock)

    async def close(self) -> None:
        await self.controller.close()

    async def __aenter__(self) -> Harness:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----- the stand-in model -----------------------------------------------------------------
    def compute(self, tokens: Sequence[int], start: int, slots: torch.Tensor) -> None:
        for pool in self.device.values():
            item = tuple(pool.buffer.shape[3:])
            data = fake_kv(tokens, start, item).to(pool.buffer.device, pool.buffer.dtype)
            for comp in range(pool.buffer.shape[0]):
                for layer in range(pool.buffer.shape[1]):
                    pool.buffer[comp, layer, slots] = data + comp + layer

    def check_prefix(self, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """The KV in ``slots`` is what computing ``tokens`` from position 0 gives."""
        n = len(slots)
        for name, pool in self.device.items():
            item = tuple(pool.buffer.shape[3:])
            want = fake_kv(tokens[:n], 0, item).to(pool.buffer.device, pool.buffer.dtype)
            for comp in range(pool.buffer.shape[0]):
                for layer in range(pool.buffer.shape[1]):
                    got = pool.buffer[comp, layer, slots]
                    assert torch.equal(got, want + comp + layer), f"pool {name} differs"

    # ----- a request, end to end ----------------------------------------------------------------
    def run_request(
        self, rid: str, tokens: list[int], extra_key: str | None = None
    ) -> dict[str, int]:
        """Match, load back host hits, compute the rest, cache it; returns tokens per source."""
        tree = self.tree
        key = RadixKey(tokens, extra_key)
        match = tree.match_prefix(key)
        device_hit = match.prefix_len
        loaded, node = tree.init_load_back(match.last_host_node)
        for transfer in tree.ready_to_load_host_cache():
            transfer.synchronize()
        prefix = torch.cat([match.device_indices, loaded]) if len(loaded) else match.device_indices
        last = node if len(loaded) else match.last_device_node
        self.check_prefix(tokens, prefix)
        tree.inc_lock_ref(last)
        need = len(tokens) - len(prefix)
        alloc = -(-need // PAGE) * PAGE
        slots = self.kv.alloc(alloc) if alloc else prefix[:0]
        if slots is None:
            tree.evict(alloc)
            slots = self.kv.alloc(alloc)
        assert slots is not None, "device full of locked pages"
        row = tree.req_to_token.alloc()
        tree.req_to_token.table[row, : len(prefix)] = prefix
        tree.req_to_token.table[row, len(prefix) : len(prefix) + alloc] = slots
        self.compute(tokens[len(prefix) :], len(prefix), slots[:need])
        req = CachedRequest(rid, tokens, row, kv_len=len(tokens), allocated=len(prefix) + alloc,
                            extra_key=extra_key, prefix_indices=prefix, last_node=last)  # fmt: skip
        tree.cache_finished_req(req)
        tree.check_events()
        return {"device": device_hit, "host": len(loaded), "computed": need}

    async def settle(self, until: Callable[[], bool] | None = None, timeout_s: float = 5.0) -> None:
        """Let background tasks run and apply their results, until ``until()`` or idle."""
        if until is None:
            await self.tree.quiesce(timeout_s)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self.tree.check_events()
            if until():
                return
            if loop.time() > deadline:
                raise AssertionError("background work did not settle")
            await self.tree.storage.wait_for_activity(0.005)

    def usage(self) -> dict[str, Any]:
        """What should return to baseline once idle."""
        tree = self.tree
        return {
            "protected": tree.protected_size,
            "host_protected": self.host[self.controller.anchor].protected_pages,
            "prefetch_pages": tree.prefetcher.pages_in_use,
            "prefetches": len(tree.prefetcher.running),
            "locked_nodes": [n.id for n in tree.all_nodes() if n.lock_ref],
        }
