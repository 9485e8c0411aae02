"""The reference backend: objects in this process's memory, bounded, least recently used out.

Every other backend is checked against this one (the conformance suite's state machine). All
work happens inside one event-loop step with no ``await`` in between, so no lock is needed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from hicache.backends.base import (
    MISS,
    Capabilities,
    ObjectInfo,
    StorageBackend,
    copy_if_fits,
    fill_from_segments,
    join_segments,
    segments_nbytes,
)
from hicache.errors import ConfigError

__all__ = ["MemoryBackend", "MemoryConfig"]


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    capacity_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError("MemoryConfig.capacity_bytes must be positive")


class MemoryBackend(StorageBackend):
    """``memory://``: a bounded LRU dict of byte objects, private to this process."""

    name = "memory"
    url_schemes = ("memory",)
    capabilities = Capabilities()
    config_type = MemoryConfig

    def __init__(self, config: MemoryConfig | None = None) -> None:
        super().__init__()
        self.config = config or MemoryConfig()
        # An object larger than the capacity is refused by put; per instance, like the capacity.
        self.capabilities = replace(self.capabilities, max_object_bytes=self.config.capacity_bytes)
        self._objects: OrderedDict[str, tuple[bytearray, float]] = OrderedDict()
        self._used = 0
        self._evictions = 0

    async def _exists(self, keys: list[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        results: list[int] = []
        for key, segs in zip(keys, buffers, strict=True):
            entry = self._objects.get(key)
            if entry is None:
                results.append(MISS)
                continue
            self._objects.move_to_end(key)
            results.append(copy_if_fits(entry[0], segs))
        return results

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        results: list[bool] = []
        for key, segs in zip(keys, values, strict=True):
            size = segments_nbytes(segs)
            if size > self.config.capacity_bytes:
                self._count("put_too_large")
                results.append(False)
                continue
            old = self._objects.get(key)
            if old is not None and len(old[0]) == size:
                # Same size (a page rewritten): reuse its memory; fresh pages cost faults.
                fill_from_segments(segs, old[0])
                self._objects[key] = (old[0], time.time())
                self._objects.move_to_end(key)
                results.append(True)
                continue
            self._drop(key)
            self._evict_for(size)
            self._objects[key] = (join_segments(segs), time.time())
            self._used += size
            results.append(True)
        return results

    async def _delete(self, keys: list[str]) -> list[bool]:
        return [self._drop(k) for k in keys]

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        # A snapshot, so puts and deletes while the caller iterates are safe.
        for key, (data, mtime) in list(self._objects.items()):
            if key.startswith(prefix):
                yield ObjectInfo(key, len(data), mtime)

    async def _stats(self) -> dict[str, int | float]:
        return {
            "objects": len(self._objects),
            "used_bytes": self._used,
            "capacity_bytes": self.config.capacity_bytes,
            "evictions": self._evictions,
        }

    async def _close(self) -> None:
        self._objects.clear()
        self._used = 0

    def _drop(self, key: str) -> bool:
        entry = self._objects.pop(key, None)
        if entry is None:
            return False
        self._used -= len(entry[0])
        return True

    def _evict_for(self, size: int) -> None:
        while self._used + size > self.config.capacity_bytes and self._objects:
            _, (data, _) = self._objects.popitem(last=False)
            self._used -= len(data)
            self._evictions += 1
