"""A tiered tree over a model with extra pools (SWA window, Mamba state), and data to check.

Every pool's data is a pure function of the tokens: a token pool's slot holds what
``fake_kv`` gives for its (token, position); a state snapshot after ``n`` tokens holds
``fake_state(tokens[:n])``. So whichever tier a page came through, :meth:`PoolKit.check` can
tell a wrong one.
"""

from __future__ import annotations

import dataclasses

import torch
from clock_kit import FakeClock
from tier_kit import CLOCK_START, PAGE, fake_kv

from hicache.keys import RadixKey
from hicache.pools.device import DevicePool, device_pools
from hicache.pools.host import HostPool, host_pools
from hicache.pools.pool_spec import ModelPools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.radix.node import TreeNode
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig, TierConfig
from hicache.tiering.controller import HiCacheController
from hicache.tiering.host.pool import host_pools_of

WINDOW = 8  # SWA window: 2 pages


def fake_state(tokens: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    value = (sum(tokens) % 97) * 0.25 + len(tokens) * 0.5
    return torch.full(shape, value, dtype=torch.float32)


@dataclasses.dataclass
class PoolKit:
    model: ModelPools
    controller: HiCacheController
    tree: HiRadixCache
    device: dict[str, DevicePool]
    host: dict[str, HostPool]
    window: int = WINDOW

    @classmethod
    async def build(
        cls,
        kind: PoolPreset,
        *,
        url: str | None = None,
        sizes: dict[str, int] | None = None,
        host_sizes: dict[str, int] | None = None,
        tiers: TierConfig | None = None,
        page: int = PAGE,
        window: int = WINDOW,
        storage: StorageConfig | None = None,
    ) -> PoolKit:
        model = preset(kind, ModelShape(page_size=page, window=window, full_layers=1))
        owners = [s.name for s in model if s.shares_slots_with is None]
        device_sizes = {name: (sizes or {}).get(name, 16 * page) for name in owners}
        device = device_pools(model, device_sizes, "cpu")
        host = host_pools(model, {name: (host_sizes or {}).get(name, 64) for name in owners})
        storage = dataclasses.replace(storage or StorageConfig(), url=url)
        config = HiCacheConfig(
            tiers or TierConfig(), PrefetchConfig(threshold_tokens=page, timeout_base_s=5), storage
        )
        controller = await HiCacheController.open(config, device, host)
        radix = RadixCacheConfig(page_size=page)
        tree = HiRadixCache(controller, radix, None, FakeClock(CLOCK_START))
        return cls(model, controller, tree, device, host, window)

    async def close(self) -> None:
        await self.controller.close(drain_s=5.0)

    async def __aenter__(self) -> PoolKit:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----- writing ------------------------------------------------------------------------
    def _fill_tokens(self, name: str, tokens: list[int], start: int, slots: torch.Tensor) -> None:
        pool = self.device[name]
        data = fake_kv(tokens, start, tuple(pool.buffer.shape[3:])).to(pool.buffer.dtype)
        for comp in range(pool.buffer.shape[0]):
            for layer in range(pool.buffer.shape[1]):
                pool.buffer[comp, layer, slots] = data + comp + layer

    def _fill_state(self, owner: str, tokens: list[int], slot: int) -> None:
        for name, pool in self.device.items():
            if name == owner or pool.spec.shares_slots_with == owner:
                state = fake_state(tokens, tuple(pool.buffer.shape[3:])).to(pool.buffer.dtype)
                pool.buffer[:, :, slot] = state

    def cache(self, tokens: list[int], snapshots: tuple[int, ...] = ()) -> bool:
        """Cache ``tokens`` (whole pages) as a request would: anchor slots for all of them, a
        window pool's slots for the last window's pages only (an ALL_PAGES one's for every
        page), a state snapshot at the end and after each length in ``snapshots``. False
        (nothing changed) when the device has no room, as an engine would not admit the
        request."""
        tree, roles = self.tree, self.tree.roles
        for n in sorted(snapshots):
            if not self.cache(tokens[:n]):
                return False
        held = max(0, len(tokens) - self.window)
        wanted = {roles.anchor: len(tokens)}
        starts = {name: held if name in roles.windows else 0 for name in roles.token_pools}
        wanted |= {name: len(tokens) - starts[name] for name in roles.token_pools}
        wanted |= dict.fromkeys(roles.state_pools, 1)
        got: dict[str, torch.Tensor] = {}
        for name, count in wanted.items():
            slots = self._alloc(name, count)
            if slots is None:
                for taken, value in got.items():
                    self.device[taken].free(value)
                return False
            got[name] = slots
        self._fill_tokens(roles.anchor, tokens, 0, got[roles.anchor])
        values: dict[str, torch.Tensor] = {}
        for name in roles.token_pools:
            values[name] = torch.full((len(tokens),), -1, dtype=torch.int64)
            lo = starts[name]  # a window pool holds the last window, another every page
            values[name][lo:] = got[name]
            self._fill_tokens(name, tokens[lo:], lo, got[name])
        for name in roles.state_pools:
            self._fill_state(name, tokens, int(got[name]))
            values[name] = got[name]
        result = tree.insert_bundle(RadixKey(tokens), got[roles.anchor], values)
        if result.already:
            self.device[roles.anchor].free(got[roles.anchor][: result.already])
        for name, unused in result.unused.items():
            if len(unused):
                self.device[name].free(unused)
        tree.check_events()
        return True

    def _alloc(self, name: str, count: int) -> torch.Tensor | None:
        slots = self.device[name].alloc(count)
        if slots is None:
            if name == self.tree.roles.anchor:
                self.tree.evict(count)
            else:
                self.tree.evict_pool(name, count)
            slots = self.device[name].alloc(count)
        return slots

    # ----- reading ------------------------------------------------------------------------
    def fetch(self, tokens: list[int]) -> tuple[int, int]:
        """Match ``tokens``, load back the host hit, check every pool's data of the prefix;
        (device hit, host hit) in tokens."""
        tree = self.tree
        first = tree.match_prefix(RadixKey(tokens))
        tree.init_load_back(first.last_host_node)
        for transfer in tree.ready_to_load_host_cache():
            transfer.synchronize()
        match = tree.match_prefix(RadixKey(tokens), count_hits=False)
        self.check(tokens[: match.prefix_len], match.device_indices, match.pool_indices)
        return first.prefix_len, first.host_hit_length

    def check(
        self, tokens: list[int], anchor: torch.Tensor, extras: dict[str, torch.Tensor | None]
    ) -> None:
        roles = self.tree.roles
        self._check_tokens(roles.anchor, tokens, 0, anchor)
        for name in roles.token_pools:
            slots = extras[name]
            assert slots is not None
            lo = max(0, len(tokens) - self.window) if name in roles.windows else 0
            assert bool((slots[lo:] >= 0).all()), f"pool {name} lacks its window"
            self._check_tokens(name, tokens[lo:], lo, slots[lo:])
        for name in self.model.names:
            owner = roles.owner_of[name]
            if owner in roles.state_pools and tokens:
                snapshot = extras[name]
                assert snapshot is not None, f"pool {name} has no snapshot at the hit's end"
                pool = self.device[name]
                want = fake_state(tokens, tuple(pool.buffer.shape[3:])).to(pool.buffer.dtype)
                for layer in range(pool.buffer.shape[1]):
                    assert torch.equal(pool.buffer[0, layer, int(snapshot)], want), name

    def _check_tokens(self, name: str, tokens: list[int], start: int, slots: torch.Tensor) -> None:
        pool = self.device[name]
        want = fake_kv(tokens, start, tuple(pool.buffer.shape[3:])).to(pool.buffer.dtype)
        for comp in range(pool.buffer.shape[0]):
            for layer in range(pool.buffer.shape[1]):
                got = pool.buffer[comp, layer, slots]
                assert torch.equal(got, want + comp + layer), f"pool {name} differs"

    # ----- accounting -----------------------------------------------------------------------
    def recount(self) -> None:
        """Every owner pool's device and host allocators hold exactly what the tree's nodes
        hold (nothing leaks, nothing is held twice), and the ledger's sizes agree."""
        tree, roles = self.tree, self.tree.roles
        nodes = tree.all_nodes()
        device: dict[str, int] = dict.fromkeys(self.controller.groups, 0)
        host: dict[str, int] = dict.fromkeys(self.controller.groups, 0)
        for node in nodes:
            device[roles.anchor] += 0 if node.value is None else len(node.value)
            host[roles.anchor] += 0 if node.host_value is None else len(node.host_value)
            for name in roles.extra:
                data = tree.ledger.data(node, name)
                device[name] += 0 if data is None else len(data)
            for name, pages in host_pools_of(node):
                host[name] += len(pages)
                assert node.host_value is not None, "an extra pool on host under no anchor"
        for name in self.controller.groups:
            assert self.device[name].used_size == device[name], f"device {name}"
            assert self.host[name].used_pages == host[name], f"host {name}"
            assert tree.ledger.size(name) == device[name], f"ledger {name}"


def nodes_holding(tree: HiRadixCache, pool: str) -> list[TreeNode]:
    return [n for n in tree.all_nodes() if tree.ledger.data(n, pool) is not None]
