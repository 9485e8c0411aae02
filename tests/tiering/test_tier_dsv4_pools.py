"""The dsv4 pools on the tiered tree, each its own lifecycle: ``c128`` and ``swa`` are evicted
from the device, kept on host and loaded back each on its own, while ``c4`` (with its indexer)
stays where it is; a host hit loads only what the device lacks."""

from __future__ import annotations

import pytest
from pool_kit import PoolKit

from hicache.pools.presets import PoolPreset
from hicache.tiering.config import TierConfig
from hicache.tiering.policies import WritePolicy
from hicache.tiering.pool_host import host_of

PAGE = 128
TOKENS = [7 * i + 1 for i in range(3 * PAGE)]
OWNERS = ("c4", "c128", "swa")


async def _kit(write: WritePolicy = WritePolicy.WRITE_THROUGH) -> PoolKit:
    tiers = TierConfig(write_policy=write)
    return await PoolKit.build(PoolPreset.DSV4, page=PAGE, window=PAGE, tiers=tiers)


@pytest.mark.parametrize("pool", ["c128", "swa"])
async def test_a_pool_evicted_alone_comes_back_from_host_alone(pool: str) -> None:
    kit = await _kit()
    try:
        tree = kit.tree
        assert kit.cache(TOKENS)
        await tree.quiesce(10)
        nodes = tree.all_nodes()
        for node in nodes:  # write-through: every pool a node holds has its own host copy
            assert node.host_value is not None
            for name in ("c128", "swa"):
                on_device = tree.ledger.data(node, name) is not None
                assert on_device == (host_of(node, name) is not None), name
        before = {name: kit.device[name].used_size for name in OWNERS}
        kept = {
            node.id: (node.value, {n: tree.ledger.data(node, n) for n in OWNERS[1:] if n != pool})
            for node in nodes
        }
        assert tree.evict_pool(pool, 10_000) == before[pool] > 0
        assert kit.device[pool].used_size == 0
        for name in OWNERS:
            assert name == pool or kit.device[name].used_size == before[name], name
        for node in nodes:  # the others' slots and data are where they were
            anchor, others = kept[node.id]
            assert node.value is anchor
            assert all(tree.ledger.data(node, n) is data for n, data in others.items())
        kit.recount()
        # Not a device hit without the pool; a host hit that loads that pool alone.
        assert kit.fetch(TOKENS) == (0, len(TOKENS))
        assert kit.device[pool].used_size == before[pool]
        for node in nodes:
            assert node.value is kept[node.id][0]  # c4 was not loaded again
        assert kit.fetch(TOKENS) == (len(TOKENS), 0)
        kit.recount()
    finally:
        await kit.close()


async def test_c4_evicted_to_host_keeps_the_other_pools_there_and_comes_back() -> None:
    """Under write-back nothing is on host until the device evicts: c4's eviction backs up
    every pool the node holds (each to its own host pages) before freeing the device."""
    kit = await _kit(WritePolicy.WRITE_BACK)
    try:
        tree = kit.tree
        assert kit.cache(TOKENS)
        assert all(n.host_value is None for n in tree.all_nodes())
        assert tree.evict(10_000) == len(TOKENS)
        assert all(kit.device[name].used_size == 0 for name in OWNERS)
        for node in tree.all_nodes():
            assert node.host_value is not None and host_of(node, "c128") is not None
        windows = [host_of(n, "swa") for n in tree.all_nodes()]
        assert sum(len(pages) for pages in windows if pages is not None) == 1  # one page
        assert kit.fetch(TOKENS) == (0, len(TOKENS))
        assert {name: kit.device[name].used_size for name in OWNERS} == {
            "c4": len(TOKENS), "c128": len(TOKENS), "swa": PAGE,
        }  # fmt: skip
        kit.recount()
    finally:
        await kit.close()
