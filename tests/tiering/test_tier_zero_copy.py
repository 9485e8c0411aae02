"""Zero-copy L3 transfers: the storage tier registers host memory with a backend that takes it,
and every segment of every page it moves then lies inside registered memory."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
from gated_kit import seed_l3, start_prefetch, tokens
from tier_kit import Harness

from hicache.backends.memory import MemoryBackend
from hicache.backends.registered_memory import MemoryRegistrar
from hicache.pools.presets import PoolPreset
from hicache.tiering.common.config import PrefetchConfig, StorageConfig

SEQ = tokens(1, 8)


class AddressCheckingBackend(MemoryBackend):
    """The memory backend, plus memory registration by address range, as Mooncake and NIXL
    do it: a segment outside every registered range is counted as staged."""

    name = "address-checking"

    def __init__(self) -> None:
        super().__init__()
        self.ranges: dict[int, int] = {}  # start -> end
        self.staged = 0
        self.direct = 0

    def register_memory(self, buffer: Any) -> bool:
        start, nbytes = _range(buffer)
        if self._inside(start, nbytes):
            return False
        self.ranges[start] = start + nbytes
        return True

    def unregister_memory(self, buffer: Any) -> bool:
        return self.ranges.pop(_range(buffer)[0], None) is not None

    def _inside(self, start: int, nbytes: int) -> bool:
        starts = sorted(self.ranges)
        i = bisect.bisect_right(starts, start) - 1
        return i >= 0 and start + nbytes <= self.ranges[starts[i]]

    def _account(self, values: list[list[memoryview]]) -> None:
        for segments in values:
            for seg in segments:
                inside = seg.nbytes and self._inside(*_range(seg))
                if inside:
                    self.direct += seg.nbytes
                else:
                    self.staged += seg.nbytes

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        self._account(values)
        return await super()._put(keys, values)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        self._account(buffers)
        return await super()._get_into(keys, buffers)


def _range(buffer: Any) -> tuple[int, int]:
    array = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)
    return int(array.ctypes.data), array.nbytes


def test_the_checking_backend_takes_registered_memory() -> None:
    assert isinstance(AddressCheckingBackend(), MemoryRegistrar)
    assert not isinstance(MemoryBackend(), MemoryRegistrar)


async def _round_trip(h: Harness) -> None:
    await seed_l3(h, SEQ)
    start_prefetch(h, "r", SEQ)
    await h.tree.quiesce(5.0)
    assert h.tree.prefetcher.inserted_tokens["r"] == len(SEQ)


async def test_pages_move_only_through_registered_memory() -> None:
    backend = AddressCheckingBackend()
    prefetch = PrefetchConfig(threshold_tokens=4)
    async with await Harness.build(
        backend=backend, prefetch=prefetch, pool_preset=PoolPreset.DSA
    ) as h:
        pools = len(h.host)  # the DSA preset: latent and indexer pools
        # Each pool's pages and header arena, and the repair check's scratch pages and headers.
        assert pools == 2 and len(backend.ranges) == 4 * pools
        await _round_trip(h)
        assert backend.staged == 0
        assert backend.direct > 2 * len(SEQ) // 4 * sum(p.spec.page_bytes for p in h.host.values())
    assert backend.ranges == {}  # unregistered when the storage tier stopped


async def test_pages_checked_before_a_skipped_write_move_through_registered_memory() -> None:
    backend = AddressCheckingBackend()
    async with await Harness.build(backend=backend, pool_preset=PoolPreset.DSA) as h:
        await seed_l3(h, SEQ)
        written = h.controller.metrics.counts["pages_written_l3"]
        await seed_l3(h, SEQ)  # computed again while L3 holds every page: read back, checked
        counts = h.controller.metrics.counts
        assert counts["pages_checked_l3"] == written and counts["pages_written_l3"] == written
        assert backend.staged == 0 and backend.direct > 0


async def test_compressed_pages_are_new_bytes_and_counted_as_staged() -> None:
    backend = AddressCheckingBackend()
    async with await Harness.build(
        backend=backend,
        prefetch=PrefetchConfig(threshold_tokens=4),
        storage=StorageConfig(compress=True),
    ) as h:
        await _round_trip(h)
        assert backend.staged > 0  # the compressed payload and its header are fresh buffers
