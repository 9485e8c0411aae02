"""Per-pool lifecycles in the tiered cache: an SWA pool keeps only its windows, a state pool its
snapshots, on every tier; a hit holds only where every pool's hit rule holds on the tier it is
read from; and every allocator holds exactly what the tree's nodes hold."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
from pool_kit import WINDOW, PoolKit, nodes_holding
from tier_kit import PAGE

from hicache.keys import RadixKey
from hicache.pools.presets import PoolPreset
from hicache.tiering.common.config import StorageConfig, TierConfig
from hicache.tiering.common.policies import WindowAdmission, WritePolicy
from hicache.tiering.host.pool import host_of


def _tokens(n: int, base: int = 0) -> list[int]:
    return [base + 7 * i + 1 for i in range(n)]


@pytest.fixture
async def swa_kit() -> AsyncIterator[PoolKit]:
    """A default SWA kit, closed after the test."""
    async with await PoolKit.build(PoolPreset.SWA) as kit:
        yield kit


async def test_swa_keeps_only_the_window_and_serves_a_hit_from_host(swa_kit: PoolKit) -> None:
    kit = swa_kit
    tokens = _tokens(24)
    kit.cache(tokens)
    holding = nodes_holding(kit.tree, "swa")
    assert sum(n.length for n in holding) == WINDOW  # the window, not all 24 tokens
    assert kit.fetch(tokens) == (24, 0)
    kit.recount()
    kit.tree.evict(10_000)  # the anchor to host (write-through backed it up)
    assert kit.tree.ledger.size("swa") == WINDOW  # the window's device slots are its own
    assert kit.tree.evict_pool("swa", 10_000) == WINDOW  # now the window goes too
    assert kit.tree.ledger.size("swa") == 0
    assert [host_of(n, "swa") is not None for n in holding] == [True]
    kit.recount()
    assert kit.fetch(tokens) == (0, 24)  # anchor and window loaded back, data checked
    kit.recount()


async def test_swa_prefix_without_its_window_is_no_hit(swa_kit: PoolKit) -> None:
    kit = swa_kit
    tokens = _tokens(24)
    kit.cache(tokens)
    other = [*tokens[:16], *_tokens(8, base=5000)]  # shares 16 tokens: no window there
    assert kit.tree.match_prefix(RadixKey(other)).prefix_len == 0
    assert kit.cache(tokens[:16])  # a request that cached exactly the 16: its window is there
    assert kit.fetch(other) == (16, 0)
    kit.recount()


async def test_a_window_needed_on_device_is_loaded_from_host_alone(swa_kit: PoolKit) -> None:
    """The anchor is on the device but the window only on host: load-back copies the window."""
    kit = swa_kit
    tokens = _tokens(24)
    kit.cache(tokens)
    assert kit.tree.evict_pool("swa", 1) == WINDOW  # backed up, then freed on the device
    match = kit.tree.match_prefix(RadixKey(tokens), count_hits=False)
    # No window on the device: no device hit at all; with the host's window, all of it.
    assert (match.prefix_len, match.host_hit_length) == (0, 24)
    assert kit.fetch(tokens) == (0, 24)
    assert kit.tree.ledger.size("kv") == 24
    assert kit.tree.ledger.size("swa") == WINDOW
    kit.recount()


async def test_hybrid_hit_ends_at_the_last_snapshot_on_every_tier() -> None:
    async with await PoolKit.build(PoolPreset.HYBRID) as kit:
        tokens = _tokens(32)
        kit.cache(tokens, snapshots=(16,))
        assert kit.tree.ledger.size("conv") == 2  # two snapshots, not one per token
        query = [*tokens[:28], *_tokens(8, base=9000)]
        assert kit.fetch(query) == (16, 0)  # 28 shared tokens, the last snapshot at 16
        kit.tree.evict(10_000)
        assert kit.tree.ledger.size("conv") == 2  # the anchor's eviction frees no snapshot
        assert kit.tree.evict_pool("conv", 10_000) == 2
        assert kit.tree.ledger.size("conv") == 0
        kit.recount()
        assert kit.fetch(query) == (0, 16)
        assert kit.fetch(tokens) == (16, 16)
        kit.recount()


@pytest.mark.parametrize("kind", [PoolPreset.SWA, PoolPreset.HYBRID, PoolPreset.DSA])
async def test_device_eviction_under_write_back_keeps_every_pool(kind: PoolPreset) -> None:
    tiers = TierConfig(write_policy=WritePolicy.WRITE_BACK)
    async with await PoolKit.build(kind, tiers=tiers, sizes={"kv": 32, "latent": 32}) as kit:
        first, second = _tokens(24), _tokens(24, base=3000)
        kit.cache(first)
        kit.cache(second)  # evicts the first to host (write_back backs it up then)
        kit.recount()
        device, host = kit.fetch(first)
        assert device + host == 24 and host > 0
        kit.recount()


@pytest.mark.parametrize("kind", [PoolPreset.SWA, PoolPreset.HYBRID])
async def test_l3_stores_each_pool_by_its_rule_and_a_restart_serves_it(
    kind: PoolPreset, tmp_path: pathlib.Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    tokens = _tokens(48)
    async with await PoolKit.build(kind, url=url) as kit:
        kit.cache(tokens, snapshots=(16, 32))
        assert kit.fetch(tokens) == (48, 0)  # a reuse: each window on the path may go to L3
        await kit.tree.quiesce(10)
        stored = await _objects_per_pool(kit)
    assert stored[kit.tree.roles.anchor] == 12
    extra = "swa" if kind is PoolPreset.SWA else "conv"
    # A window's 2 pages, or 1 snapshot, at each of the three ends 16, 32 and 48.
    assert stored[extra] == (3 * WINDOW // PAGE if kind is PoolPreset.SWA else 3)
    async with await PoolKit.build(kind, url=url) as again:
        tree = again.tree
        query = [*tokens[:44], *_tokens(4, base=7000)]
        match = tree.match_prefix(RadixKey(query), count_hits=False)
        assert tree.prefetcher.start("r1", RadixKey(query), match)
        await tree.quiesce(10)
        assert again.fetch(query) == (0, 32)  # 44 shared, the last usable end in L3 at 32
        again.recount()


async def _objects_per_pool(kit: PoolKit) -> dict[str, int]:
    """Objects in L3 by pool (the format digest in each key names the pool)."""
    backend = kit.tree.storage.backend
    assert backend is not None
    by_digest = {fmt.digest: name for name, fmt in kit.controller.bundler.formats.items()}
    counts = dict.fromkeys(by_digest.values(), 0)
    async for info in backend.scan():
        counts[by_digest[info.key.split("-")[1]]] += 1
    return counts


async def test_dsv4_pools_keep_compressed_entries_everywhere_and_the_window_at_ends(
    tmp_path: pathlib.Path,
) -> None:
    url = f"file://{tmp_path / 'store'}"
    tokens = _tokens(512)
    async with await PoolKit.build(PoolPreset.DSV4, url=url, page=128, window=128) as kit:
        assert kit.cache(tokens)
        assert kit.tree.ledger.size("swa") == 128  # one window page of four
        assert kit.fetch(tokens) == (512, 0)
        await kit.tree.quiesce(10)
        stored = await _objects_per_pool(kit)
        kit.tree.evict(10_000)
        assert kit.fetch(tokens) == (0, 512)
        kit.recount()
    assert stored == {"c4": 4, "indexer": 4, "c128": 4, "swa": 1}
    # A page of 128 tokens holds 32 C4 entries and one C128 entry per layer.
    shape = kit.model.pool("c4").layout
    assert kit.model.pool("c4").page_bytes == shape.layers * (128 // 4) * 32 * 2
    assert kit.model.pool("c128").page_bytes == shape.layers * 1 * 128 * 2


async def test_a_window_goes_to_l3_once_reused(tmp_path: pathlib.Path) -> None:
    """Under the default window admission a window no request reused stays out of L3 (the
    anchor's pages go); the first hit on its node writes it. ALL writes every window."""
    tokens = _tokens(24)
    async with await PoolKit.build(PoolPreset.SWA, url=f"file://{tmp_path / 'reused'}") as kit:
        kit.cache(tokens)
        await kit.tree.quiesce(10)
        assert (await _objects_per_pool(kit)) == {"kv": 6, "swa": 0}
        kit.fetch(tokens)
        await kit.tree.quiesce(10)
        assert (await _objects_per_pool(kit)) == {"kv": 6, "swa": WINDOW // PAGE}
    storage = StorageConfig(window_admission=WindowAdmission.ALL)
    url = f"file://{tmp_path / 'all'}"
    async with await PoolKit.build(PoolPreset.SWA, url=url, storage=storage) as kit:
        kit.cache(tokens)
        await kit.tree.quiesce(10)
        assert (await _objects_per_pool(kit)) == {"kv": 6, "swa": WINDOW // PAGE}


async def test_a_store_written_with_another_window_serves_only_where_it_suffices(
    tmp_path: pathlib.Path,
) -> None:
    """Windows stored by a model with an 8-token window serve one with a 16-token window only
    at an end whose 16 tokens of window pages happen to be stored: 32 here, not 48 (its 8-token
    window only). Never a window with a hole."""
    url = f"file://{tmp_path / 'store'}"
    tokens = _tokens(48)
    async with await PoolKit.build(PoolPreset.SWA, url=url, window=8) as kit:
        for end in (48, 32, 24):  # windows [40, 48), [24, 32), [16, 24)
            kit.cache(tokens[:end])
            kit.fetch(tokens[:end])  # reused: the window may go to L3
        await kit.tree.quiesce(10)
    async with await PoolKit.build(PoolPreset.SWA, url=url, window=16) as wide:
        tree = wide.tree
        key = RadixKey(tokens)
        assert tree.prefetcher.start("r", key, tree.match_prefix(key, count_hits=False))
        await tree.quiesce(10)
        assert wide.fetch(tokens) == (0, 32)
        wide.recount()


async def test_a_load_back_that_cannot_place_a_window_says_nothing_was_loaded() -> None:
    """Only the window is missing on the device and the window pool is full of locked data:
    nothing is loaded, and the node returned is not the prefix's end (which would claim the
    prefix is on the device)."""
    async with await PoolKit.build(PoolPreset.SWA, sizes={"swa": WINDOW}) as kit:
        first, other = _tokens(24), _tokens(24, base=5000)
        assert kit.cache(first)
        assert kit.tree.evict_pool("swa", 1) == WINDOW  # to host: the pool is empty again
        assert kit.cache(other)
        held = kit.tree.match_prefix(RadixKey(other), count_hits=False).last_device_node
        kit.tree.ledger.lock(held, "swa")  # the pool's only window may not be evicted
        match = kit.tree.match_prefix(RadixKey(first), count_hits=False)
        assert (match.prefix_len, match.host_hit_length) == (0, 24)
        end = match.last_host_node
        assert end is not None
        loaded, node = kit.tree.init_load_back(end)
        assert len(loaded) == 0 and node is not end
        assert kit.tree.ready_to_load_host_cache() == []
        kit.tree.ledger.unlock(held, "swa")
        kit.recount()
