"""The memory backend: the conformance suite plus its LRU bound and byte accounting.

A variant that cannot list runs the suite too, so its ``listable=False`` branches are checked.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
from memory_kit import read_memory_raw, write_memory_raw

from hicache.backends.base import Capabilities, ObjectInfo, StorageBackend
from hicache.backends.memory import MemoryBackend, MemoryConfig
from hicache.backends.registry import open_backend
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import ConfigError


class TestMemoryConformance(BackendConformanceTests):
    # The reference semantics get a longer run of the model than other backends: it is cheap.
    state_machine_examples = 100

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        # 256 MiB: room for the 64 MiB object and everything else, so nothing is evicted.
        return await MemoryBackend.open(MemoryConfig(capacity_bytes=256 << 20))

    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        return read_memory_raw(backend, key)

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        write_memory_raw(backend, key, data)


class _UnlistedMemory(MemoryBackend):
    """A store that cannot list, as Mooncake without its admin server: scan raises."""

    capabilities = Capabilities(listable=False)

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        raise ConfigError("this store cannot list its keys")
        yield  # an async generator, like a real one: the error comes at iteration


class TestUnlistedMemoryConformance(TestMemoryConformance):
    state_machine_examples = 25

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return _UnlistedMemory(MemoryConfig(capacity_bytes=256 << 20))


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


async def test_too_large_put_fails_and_keeps_the_old_value() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=100))
    assert await backend.put(["k"], [b"old"]) == [True]
    assert await backend.put(["k", "j"], [b"n" * 101, b"ok"]) == [False, True]
    assert await backend.get(["k", "j"]) == [b"old", b"ok"]
    stats = await backend.stats()
    assert (stats["put_failures"], stats["put_too_large"], stats["puts"]) == (1, 1, 2)


async def test_used_bytes_follow_overwrite_and_delete() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=1000))
    assert await backend.put(["a", "b"], [b"1" * 100, b"2" * 50]) == [True, True]
    assert await backend.put(["a"], [b"3" * 10]) == [True]  # shrinks in place, evicts nothing
    assert await backend.delete(["b"]) == [True]
    stats = await backend.stats()
    assert (stats["used_bytes"], stats["objects"], stats["evictions"]) == (10, 1, 0)


async def test_overwrite_that_needs_room_evicts_others_not_itself() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=200))
    assert await backend.put(["a", "b"], [b"1" * 100, b"2" * 100]) == [True, True]
    assert await backend.put(["b"], [b"3" * 150]) == [True]
    assert await backend.exists(["a", "b"]) == [False, True]
    assert (await backend.stats())["used_bytes"] == 150


async def test_close_drops_objects() -> None:
    backend = MemoryBackend()
    assert await backend.put(["a"], [b"x" * 10]) == [True]
    await backend.close()
    stats = await backend.stats()  # the base counters stay readable after close
    assert stats["puts"] == 1 and "used_bytes" not in stats


def test_config_refuses_non_positive_capacity() -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        MemoryConfig(capacity_bytes=0)


def test_config_from_url_parses_sizes() -> None:
    config = MemoryBackend.config_from_url("memory://?capacity_bytes=512M", {})
    assert config == MemoryConfig(capacity_bytes=512 << 20)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        MemoryBackend.config_from_url("memory://?capacity_bytes=lots", {})


def test_capacity_is_the_object_cap() -> None:
    assert MemoryBackend(MemoryConfig(capacity_bytes=1000)).capabilities.max_object_bytes == 1000
    assert MemoryBackend.capabilities.max_object_bytes is None  # per instance, from the config


async def test_url_takes_no_location() -> None:
    for url in ("memory://cache-a", "memory:///cache-a", "memory://h/p?capacity_bytes=1M"):
        with pytest.raises(ConfigError, match="memory:// URLs take no"):
            await open_backend(url)
