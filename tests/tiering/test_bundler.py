"""Bundles: every pool's object of a page stored and loaded together; a page is all or nothing."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import FaultConfig, FaultInjectionBackend, Operation
from hicache.codec import NO_PARENT
from hicache.errors import InvalidArgumentError
from hicache.keys import RadixKey, chain_page_hashes, namespace_digest
from hicache.layouts import Layout
from hicache.pools import HostPool
from hicache.pools.presets import PoolPreset, preset
from hicache.radix.tree import RadixCache, RadixCacheConfig
from hicache.tiering.l3.bundler import BundlePage, PageBundler, PageHasher

NS = namespace_digest("tiny-model")


def host_pools(kind: PoolPreset, layout: Layout, seed: int | None) -> dict[str, HostPool]:
    model = preset(kind)
    owners: dict[str, HostPool] = {}
    for spec in model:
        owner = owners.get(spec.shares_slots_with) if spec.shares_slots_with else None
        owners[spec.name] = HostPool(spec, 8, layout, pin_memory=False, owner=owner)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for pool in owners.values():
            raw = pool.buffer.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return owners


def chain(n: int, pools: list[str]) -> list[BundlePage]:
    pages, parent = [], NO_PARENT
    for i in range(n):
        h = hashlib.sha256(parent + bytes([i])).digest()
        pages.append(BundlePage(NS, h, {name: i for name in pools}, i, parent))
        parent = h
    return pages


@pytest.mark.parametrize(
    "layout", [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, Layout.LAYER_FIRST]
)
@pytest.mark.parametrize("kind", [PoolPreset.DENSE, PoolPreset.DSA, PoolPreset.HYBRID])
@pytest.mark.parametrize("compress", [False, True])
async def test_round_trip_every_pool(kind: PoolPreset, layout: Layout, compress: bool) -> None:
    source = host_pools(kind, layout, seed=1)
    backend = MemoryBackend()
    writer = PageBundler("tiny-model", source, compress=compress)
    pages = chain(4, list(source))
    assert await writer.write(backend, pages) == [True] * 4
    assert len(await _all_keys(backend)) == 4 * len(source)
    dest = host_pools(kind, layout, seed=None)
    reader = PageBundler("tiny-model", dest)
    assert await reader.read(backend, pages) == 4
    for name in source:
        for page in range(4):
            assert raw(source[name].read_page(page)) == raw(dest[name].read_page(page)), name


async def test_a_page_missing_one_pool_ends_the_hit() -> None:
    source = host_pools(PoolPreset.DSA, Layout.PAGE_FIRST, seed=2)
    backend = MemoryBackend()
    bundler = PageBundler("tiny-model", source)
    pages = chain(5, list(source))
    await bundler.write(backend, pages)
    await backend.delete([bundler.keys(pages[2])["indexer"]])  # the latent of page 2 is still there
    assert await bundler.read(backend, pages) == 2
    assert bundler.metrics.counts["missing_pages"] == 1


async def test_corrupt_objects_are_misses_never_loaded() -> None:
    source = host_pools(PoolPreset.DENSE, Layout.PAGE_FIRST, seed=3)
    inner = MemoryBackend()
    pages = chain(3, ["kv"])
    await PageBundler("tiny-model", source).write(inner, pages)
    flaky = FaultInjectionBackend(
        inner, FaultConfig(corrupt_rate=1.0, operations=frozenset({Operation.GET}))
    )
    reader = PageBundler("tiny-model", host_pools(PoolPreset.DENSE, Layout.PAGE_FIRST, None))
    assert await reader.read(flaky, pages) == 0
    assert reader.metrics.counts["corrupt_pages"] >= 1


async def test_another_model_or_layout_never_hits() -> None:
    source = host_pools(PoolPreset.DENSE, Layout.PAGE_FIRST, seed=4)
    backend = MemoryBackend()
    pages = chain(2, ["kv"])
    await PageBundler("tiny-model", source).write(backend, pages)
    for other in (
        PageBundler("other-model", host_pools(PoolPreset.DENSE, Layout.PAGE_FIRST, None)),
        PageBundler("tiny-model", host_pools(PoolPreset.DENSE, Layout.PAGE_FIRST, None), "tp1of2"),
    ):
        assert await other.read(backend, pages) == 0
    # layer_first and page_first_direct pages have the same stored bytes: they share objects.
    direct = PageBundler("tiny-model", host_pools(PoolPreset.DENSE, Layout.PAGE_FIRST_DIRECT, 5))
    await direct.write(backend, pages)
    layer_first = host_pools(PoolPreset.DENSE, Layout.LAYER_FIRST, None)
    assert await PageBundler("tiny-model", layer_first).read(backend, pages) == 2


def test_bad_pages_are_refused() -> None:
    bundler = PageBundler("tiny-model", host_pools(PoolPreset.DENSE, Layout.PAGE_FIRST, None))
    with pytest.raises(InvalidArgumentError):
        bundler.keys(BundlePage(NS, bytes(32), {"nosuch": 0}))
    with pytest.raises(InvalidArgumentError):
        bundler.keys(BundlePage(NS, bytes(32), {}))
    with pytest.raises(InvalidArgumentError):
        PageBundler("tiny-model", {})


def raw(page: torch.Tensor) -> bytes:
    """Bytes, not values: random bit patterns include NaNs, which never compare equal."""
    return page.reshape(-1).view(torch.uint8).numpy().tobytes()


async def _all_keys(backend: MemoryBackend) -> list[str]:
    return [info.key async for info in backend.scan()]


# ----- page identity (PageHasher) -------------------------------------------------------------
def _hasher_tree() -> tuple[PageHasher, RadixCache]:
    return PageHasher("tiny-model", 4, ["kv"]), RadixCache(RadixCacheConfig(4, simulated=True))


def test_node_hashes_do_not_depend_on_where_the_tree_splits() -> None:
    hasher, tree = _hasher_tree()
    tokens = list(range(40, 64))  # 6 pages
    tree.insert(RadixKey(tokens))
    whole = tree.match_prefix(RadixKey(tokens)).last_device_node
    before = list(hasher.node_hashes(whole))
    tree.insert(RadixKey(tokens[:8] + [999] * 4))  # splits the node after two pages
    path = tree.match_prefix(RadixKey(tokens)).path
    assert len(path) == 2
    after = [h for node in path for h in hasher.node_hashes(node)]
    expected = chain_page_hashes(RadixKey(tokens), 4, namespace_digest("tiny-model", None))
    assert before == after == expected


def test_node_bundle_chains_parents_and_continues_its_parent_node() -> None:
    hasher, tree = _hasher_tree()
    tokens = list(range(24))
    tree.insert(RadixKey(tokens[:8]))
    tree.insert(RadixKey(tokens))
    lower = tree.match_prefix(RadixKey(tokens)).path[-1]
    bundle = hasher.node_bundle(lower, [{"kv": h} for h in (5, 6, 7, 8)])
    hashes = chain_page_hashes(RadixKey(tokens), 4, namespace_digest("tiny-model", None))
    assert [p.page_hash for p in bundle] == hashes[2:]
    assert [p.parent_hash for p in bundle] == hashes[1:-1]
    assert [p.page_index for p in bundle] == [2, 3, 4, 5]
    assert [dict(p.host_pages) for p in bundle] == [{"kv": h} for h in (5, 6, 7, 8)]


def test_candidates_continue_the_chain_below_a_node() -> None:
    hasher, tree = _hasher_tree()
    tokens = list(range(24))
    tree.insert(RadixKey(tokens[:8]))
    below = tree.match_prefix(RadixKey(tokens)).last_device_node
    candidates = hasher.candidates(RadixKey(tokens), 8, 24, below)
    hashes = chain_page_hashes(RadixKey(tokens), 4, namespace_digest("tiny-model", None))
    assert [c.page_hash for c in candidates] == hashes[2:]
    assert candidates[0].parent_hash == hashes[1] and candidates[0].page_index == 2
    assert all(dict(c.host_pages) == {"kv": -1} for c in candidates)
    first = hasher.candidates(RadixKey(tokens), 0, 8, tree.namespace_root(None))
    assert first[0].parent_hash == NO_PARENT and [c.page_hash for c in first] == hashes[:2]
