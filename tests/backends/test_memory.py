"""The memory backend: the conformance suite plus its LRU bound."""

from __future__ import annotations

import pathlib

from hicache.backends.base import StorageBackend
from hicache.backends.memory import MemoryBackend, MemoryConfig
from hicache.backends.testing import BackendConformanceTests


class TestMemoryConformance(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await MemoryBackend.open(MemoryConfig(capacity_bytes=256 << 20))


async def test_lru_evicts_least_recently_used() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=300))
    assert await backend.put(["a", "b", "c"], [b"x" * 100] * 3) == [True] * 3
    buf = bytearray(100)
    assert await backend.get_into(["a"], [buf]) == [100]  # a is now the most recent
    assert await backend.put(["d"], [b"y" * 100]) == [True]
    assert await backend.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    stats = await backend.stats()
    assert stats["evictions"] == 1 and stats["used_bytes"] == 300
    assert await backend.put(["huge"], [b"z" * 301]) == [False]
