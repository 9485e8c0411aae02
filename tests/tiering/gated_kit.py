"""A backend wrapper whose calls wait at gates the test opens, so a "stalled" L3 is deterministic.

``GatedBackend(MemoryBackend(), get=Gate())`` makes every ``get_into`` wait until the test lets
it through, one call per :meth:`Gate.release` or all of them once :meth:`Gate.open`; the other
operations pass straight to the inner backend unless they have a gate too. Helpers to seed L3
through a harness and to wait on background work without applying its results live here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tier_kit import Harness

from hicache.backends.base import StorageBackend
from hicache.backends.wrappers import WrapperBackend
from hicache.keys import RadixKey
from hicache.tiering.l3.storage_tier import PrefetchOp


class Gate:
    """Calls wait here until passes are released; ``waiting`` counts the calls held now."""

    def __init__(self, opened: bool = False) -> None:
        self._opened = opened
        self._passes = 0
        self._changed = asyncio.Event()
        self.waiting = 0
        self.passed = 0

    async def wait(self) -> None:
        self.waiting += 1
        try:
            while not (self._opened or self._passes > 0):
                self._changed.clear()
                await self._changed.wait()
            if not self._opened:
                self._passes -= 1
            self.passed += 1
        finally:
            self.waiting -= 1

    def release(self, calls: int = 1) -> None:
        self._passes += calls
        self._changed.set()

    def open(self) -> None:
        self._opened = True
        self._changed.set()

    def shut(self) -> None:
        """Hold calls again from now on (calls already past stay past)."""
        self._opened = False


class GatedBackend(WrapperBackend):
    """Forwards to ``inner`` after the gate of the operation, when it has one."""

    name = "gated"

    def __init__(
        self,
        inner: StorageBackend,
        *,
        get: Gate | None = None,
        put: Gate | None = None,
        exists: Gate | None = None,
    ) -> None:
        super().__init__(inner)
        self.get_gate, self.put_gate, self.exists_gate = get, put, exists

    async def _exists(self, keys: list[str]) -> list[bool]:
        if self.exists_gate is not None:
            await self.exists_gate.wait()
        return await self.inner.exists(keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        if self.get_gate is not None:
            await self.get_gate.wait()
        return await self.inner.get_into(keys, buffers)

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        if self.put_gate is not None:
            await self.put_gate.wait()
        return await self.inner.put(keys, values)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Yield to background tasks until ``condition()``, without applying their results."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def quiesce(h: Harness) -> None:
    """Run background work to its end and apply its results."""
    await h.tree.quiesce(5.0)


BASELINE = {
    "protected": 0,
    "host_protected": 0,
    "prefetch_pages": 0,
    "prefetches": 0,
    "locked_nodes": [],
}


async def assert_clean(h: Harness) -> None:
    """Once idle: nothing locked or reserved, and every used page belongs to a tree node."""
    await quiesce(h)
    assert h.usage() == BASELINE
    nodes = h.tree.all_nodes()
    on_host = sum(len(n.host_value) for n in nodes if n.host_value is not None)
    assert h.host[h.controller.anchor].used_pages == on_host, "host pages leaked"
    assert h.kv.used_size == sum(n.length for n in nodes if n.value is not None), "slots leaked"


def tokens(first: int, pages: int, page: int = 4) -> list[int]:
    """``pages`` whole pages of distinct token ids starting at ``first``."""
    return list(range(first, first + pages * page))


async def seed_l3(h: Harness, *sequences: list[int]) -> None:
    """Write ``sequences`` through to L3, then evict them from device and host: L3 only."""
    for i, seq in enumerate(sequences):
        h.run_request(f"seed{i}", seq)
    await quiesce(h)
    assert h.controller.metrics.counts["pages_written_l3"] > 0, "seeding wrote nothing to L3"
    h.tree.evict(10**6)
    h.tree.host_evictor.evict(10**6)
    assert h.host[h.controller.anchor].used_pages == 0 and h.kv.used_size == 0
    assert not h.tree.all_nodes()


def start_prefetch(h: Harness, rid: str, seq: list[int]) -> PrefetchOp:
    """Match ``seq`` and start its prefetch; the op (kept after the tree forgets it)."""
    key = RadixKey(seq)
    match = h.tree.match_prefix(key)
    assert h.tree.prefetcher.start(rid, key, match), "prefetch was not started"
    return h.tree.prefetcher.running[rid]
