"""How much a prefetch asks L3: in batches that double from ``batch_pages``, stopping after the
first page whose anchor objects L3 lacks (no usable prefix reaches past it), with the same hit as
asking about every page."""

from __future__ import annotations

import pathlib

import pytest
from pool_kit import PoolKit
from tier_gated import quiesce, seed_l3, start_prefetch, tokens, until
from tier_harness import Harness

from hicache.backends.base import StorageBackend
from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import WrapperBackend
from hicache.keys import RadixKey
from hicache.pools.presets import PoolPreset
from hicache.tiering.common.config import PrefetchConfig

PAGE = 4  # tier_harness's page size


class CountedLookups(WrapperBackend):
    """Records the keys of every ``exists`` call."""

    name = "counted-lookups"

    def __init__(self, inner: StorageBackend | None = None) -> None:
        super().__init__(inner or MemoryBackend())
        self.asked: list[list[str]] = []

    async def _exists(self, keys: list[str]) -> list[bool]:
        self.asked.append(list(keys))
        return await self.inner.exists(keys)


async def _prefetched(
    preset: PoolPreset, seeded_pages: int, asked_pages: int, batch_pages: int
) -> tuple[int, list[int], int]:
    """Seed L3 with ``seeded_pages`` pages, then prefetch ``asked_pages`` pages that start with
    them: (pages L3 was found to hold, pages asked about per ``exists`` call, objects per page)."""
    backend = CountedLookups()
    prefetch = PrefetchConfig(threshold_tokens=PAGE, timeout_base_s=1.0, batch_pages=batch_pages)
    h = await Harness.build(
        backend=backend, prefetch=prefetch, pool_preset=preset, device_tokens=512, host_pages=256
    )
    try:
        seq = tokens(1, asked_pages)
        await seed_l3(h, seq[: seeded_pages * PAGE])
        per_page = len(h.controller.storage.bundler.host_pools)
        backend.asked.clear()
        counts = h.controller.metrics.counts
        before = counts["l3_lookup_pages"], counts["l3_lookup_candidates"]
        op = start_prefetch(h, "r", seq)
        await until(lambda: op.reads_finished)
        await quiesce(h)
        assert op.hit_pages is not None
        asked = sum(len(keys) for keys in backend.asked) // per_page
        # The counters the serving report shows: pages asked about, of the candidates.
        assert (counts["l3_lookup_pages"], counts["l3_lookup_candidates"]) == (
            before[0] + asked,
            before[1] + len(op.candidates),
        )
        return op.hit_pages, [len(keys) // per_page for keys in backend.asked], per_page
    finally:
        await h.close()


async def test_a_prefetch_stops_asking_after_the_first_page_l3_lacks() -> None:
    hit, asked, _ = await _prefetched(PoolPreset.DENSE, 4, 64, batch_pages=8)
    assert hit == 4
    assert asked == [8]  # one batch held the miss; the other 56 pages were never asked about


async def test_the_batches_double_until_one_holds_the_miss() -> None:
    hit, asked, _ = await _prefetched(PoolPreset.DENSE, 20, 64, batch_pages=4)
    assert hit == 20
    assert asked == [4, 8, 16]  # 28 pages asked; the miss is page 21, in the third batch


async def test_a_prefetch_of_pages_all_in_l3_asks_about_each_once() -> None:
    hit, asked, _ = await _prefetched(PoolPreset.DENSE, 24, 24, batch_pages=4)
    assert hit == 24
    assert asked == [4, 8, 12]  # the last batch is what is left


async def test_a_sidecar_stops_the_lookup_like_its_anchor() -> None:
    """DSA: a page is usable only with both its latent and its indexer keys; the hit is what
    the planner gives when asked about every page."""
    hit_all, asked_all, per_page = await _prefetched(PoolPreset.DSA, 12, 12, batch_pages=64)
    assert asked_all == [12] and per_page == 2
    hit, asked, _ = await _prefetched(PoolPreset.DSA, 12, 64, batch_pages=4)
    assert hit == hit_all == 12
    assert asked == [4, 8, 16]


@pytest.mark.parametrize("kind", [PoolPreset.SWA, PoolPreset.HYBRID])
async def test_windows_and_snapshots_are_asked_about_up_to_the_anchors_first_miss(
    kind: PoolPreset, tmp_path: pathlib.Path
) -> None:
    """A stored prefix of 48 tokens (windows or snapshots at 16, 32 and 48), then a query that
    shares 44 of them and goes on for 40 pages: the lookup ends in the first batch of 32 pages
    (the anchor misses at page 12), and the hit is the last usable end before it, 32 tokens."""
    url = f"file://{tmp_path / 'store'}"
    stored = list(range(48))
    kit = await PoolKit.build(kind, url=url)
    try:
        kit.cache(stored, snapshots=(16, 32))
        assert kit.fetch(stored) == (48, 0)  # a reuse: each window on the path may go to L3
        await kit.tree.quiesce(10)
    finally:
        await kit.close()
    again = await PoolKit.build(kind, url=url)
    storage = again.controller.storage
    assert storage.backend is not None
    counted = CountedLookups(storage.backend)
    storage.backend = counted
    try:
        query = [*stored[:44], *range(7000, 7000 + 40 * PAGE)]
        match = again.tree.match_prefix(RadixKey(query), count_hits=False)
        assert again.tree.prefetcher.start("r1", RadixKey(query), match)
        await again.tree.quiesce(10)
        per_page = len(storage.bundler.host_pools)
        assert [len(keys) // per_page for keys in counted.asked] == [32]  # of 51 candidates
        assert again.fetch(query) == (0, 32)
        again.recount()
    finally:
        storage.backend = counted.inner
        await again.close()
