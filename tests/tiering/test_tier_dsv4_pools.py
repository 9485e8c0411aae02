"""The dsv4 pools on the tiered tree, each its own lifecycle: ``c4`` (with its indexer),
``c128`` and ``swa`` are evicted from the device, kept on host and loaded back each on its own,
while the others stay where they are; a host hit loads only what the device lacks, and host
eviction frees every pool of a node it takes out once."""

from __future__ import annotations

import pytest
import torch
from pool_kit import PoolKit

from hicache.keys import RadixKey
from hicache.pools.presets import PoolPreset
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import TierConfig
from hicache.tiering.common.policies import WritePolicy
from hicache.tiering.host.pool import host_of

PAGE = 128
TOKENS = [7 * i + 1 for i in range(3 * PAGE)]
OWNERS = ("c4", "c128", "swa")


async def _kit(write: WritePolicy = WritePolicy.WRITE_THROUGH) -> PoolKit:
    tiers = TierConfig(write_policy=write)
    return await PoolKit.build(PoolPreset.DSV4, page=PAGE, window=PAGE, tiers=tiers)


@pytest.mark.parametrize("pool", ["c128", "swa"])
async def test_a_pool_evicted_alone_comes_back_from_host_alone(pool: str) -> None:
    async with await _kit() as kit:
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


def _sizes(tree: HiRadixCache) -> dict[str, tuple[int, int, int]]:
    """Per owner pool: the ledger's (size, evictable, protected)."""
    ledger = tree.ledger
    return {n: (ledger.size(n), ledger.evictable(n), ledger.protected(n)) for n in OWNERS}


async def _c4_on_host(kit: PoolKit) -> dict[int, dict[str, torch.Tensor | None]]:
    """Cache TOKENS under write-back and evict c4 to host; each node's c128 and swa device
    data, which that eviction must leave where it was."""
    tree = kit.tree
    assert kit.cache(TOKENS)
    assert all(n.host_value is None for n in tree.all_nodes())
    before = {n.id: {p: tree.ledger.data(n, p) for p in OWNERS[1:]} for n in tree.all_nodes()}
    sizes = _sizes(tree)
    assert tree.evict(10_000) == len(TOKENS)
    assert kit.device["c4"].used_size == 0
    assert kit.device["c128"].used_size == len(TOKENS) and kit.device["swa"].used_size == PAGE
    after = _sizes(tree)
    assert after["c4"] == (0, 0, 0)
    assert {p: after[p] for p in OWNERS[1:]} == {p: sizes[p] for p in OWNERS[1:]}
    assert after["c128"] == (len(TOKENS), len(TOKENS), 0) and after["swa"] == (PAGE, PAGE, 0)
    for node in tree.all_nodes():  # on host now, the other pools still on the device
        assert node.value is None and node.host_value is not None
        assert all(tree.ledger.data(node, p) is d for p, d in before[node.id].items())
    kit.recount()
    return before


async def test_c4_evicted_to_host_keeps_the_other_pools_on_the_device() -> None:
    """Under write-back nothing is on host until the device evicts: c4's eviction backs c4 up
    and frees c4's device slots only; loading c4 back makes the prefix a device hit again
    without loading c128 or swa."""
    async with await _kit(WritePolicy.WRITE_BACK) as kit:
        tree = kit.tree
        kept = await _c4_on_host(kit)
        key = RadixKey(TOKENS)
        match = tree.match_prefix(key, count_hits=False)  # the device part needs c4 there
        assert (match.prefix_len, match.host_hit_length) == (0, len(TOKENS))
        peek = tree.peek_tiers(key)
        assert (peek.device, peek.host) == (0, len(TOKENS))
        assert kit.fetch(TOKENS) == (0, len(TOKENS))
        assert {name: kit.device[name].used_size for name in OWNERS} == {
            "c4": len(TOKENS), "c128": len(TOKENS), "swa": PAGE,
        }  # fmt: skip
        for node in tree.all_nodes():  # c128 and swa were not loaded again
            assert node.value is not None
            assert all(tree.ledger.data(node, p) is d for p, d in kept[node.id].items())
        assert kit.fetch(TOKENS) == (len(TOKENS), 0)
        kit.recount()


async def test_each_pool_evicted_after_c4_goes_to_host_and_comes_back() -> None:
    async with await _kit(WritePolicy.WRITE_BACK) as kit:
        tree = kit.tree
        await _c4_on_host(kit)
        assert tree.evict_pool("c128", 10_000) == len(TOKENS)
        assert tree.evict_pool("swa", 10_000) == PAGE
        assert all(kit.device[name].used_size == 0 for name in OWNERS)
        assert all(_sizes(tree)[name] == (0, 0, 0) for name in OWNERS)
        for node in tree.all_nodes():
            assert node.host_value is not None and host_of(node, "c128") is not None
        windows = [host_of(n, "swa") for n in tree.all_nodes()]
        assert sum(len(pages) for pages in windows if pages is not None) == 1  # one page
        kit.recount()
        assert kit.fetch(TOKENS) == (0, len(TOKENS))
        assert {name: kit.device[name].used_size for name in OWNERS} == {
            "c4": len(TOKENS), "c128": len(TOKENS), "swa": PAGE,
        }  # fmt: skip
        kit.recount()


async def test_host_eviction_frees_every_pool_of_the_node_once() -> None:
    """A node on host with c128 and swa on the device: host eviction keeps it while a pool
    lock holds it, then takes it out, freeing its host pages and the other pools' device slots
    exactly once (a second free of a slot would raise)."""
    async with await _kit(WritePolicy.WRITE_BACK) as kit:
        tree = kit.tree
        await _c4_on_host(kit)
        leaf = next(n for n in tree.all_nodes() if not n.children)
        tree.ledger.lock(leaf, "c128")
        assert tree.host_evictor.evict(10_000) == 0  # the leaf is held, its parent too
        assert _sizes(tree)["c128"] == (len(TOKENS), 0, len(TOKENS))
        tree.ledger.unlock(leaf, "c128")
        assert tree.host_evictor.evict(10_000) == len(TOKENS)
        assert tree.all_nodes() == []
        for name in OWNERS:
            assert kit.device[name].used_size == 0, name
            assert kit.host[name].used_pages == 0, name
            assert _sizes(tree)[name] == (0, 0, 0), name
        kit.recount()
        assert kit.fetch(TOKENS) == (0, 0)
        assert kit.cache(TOKENS)  # the freed slots serve a new request
        assert kit.fetch(TOKENS) == (len(TOKENS), 0)
        kit.recount()


async def test_a_pool_backed_up_as_it_is_evicted_keeps_its_node_while_host_makes_room() -> None:
    """c128's host pool holds one page, which a node anchoring a load-back keeps. Evicting c128
    from a node whose c4 is on host tries to back it up; the host eviction that looks for room
    must not take out the node being copied (its device slots would be freed under the copy):
    c128 is dropped on the device without a copy instead, and c4 stays on host."""
    tiers = TierConfig(write_policy=WritePolicy.WRITE_BACK)
    async with await PoolKit.build(
        PoolPreset.DSV4, page=PAGE, window=PAGE, tiers=tiers, host_sizes={"c128": 1}
    ) as kit:
        tree = kit.tree
        first, second = TOKENS[:PAGE], [t + 5 for t in TOKENS[:PAGE]]
        assert kit.cache(first) and tree.evict(10_000) == PAGE
        (kept,) = tree.all_nodes()
        assert tree.evict_pool("c128", 10_000) == PAGE
        assert host_of(kept, "c128") is not None  # the host pool's one page, its only copy
        tree.host_evictor.anchors[kept.id] += 1
        assert kit.cache(second) and tree.evict(10_000) == PAGE
        (node,) = [n for n in tree.all_nodes() if n is not kept]
        assert host_of(node, "c128") is None and tree.ledger.data(node, "c128") is not None
        assert tree.evict_pool("c128", 10_000) == PAGE
        assert node.parent is not None and node.host_value is not None  # still in the tree
        assert tree.ledger.data(node, "c128") is None and host_of(node, "c128") is None
        assert kit.device["c128"].used_size == 0
        kit.recount()
        assert kit.fetch(second) == (0, 0)  # c128 is on no tier: no hit
        tree.host_evictor.anchors[kept.id] -= 1
        assert kit.fetch(first) == (0, PAGE)
        kit.recount()
