"""``example://label``: the smallest complete backend, a dict of byte strings in this process.

It is written the way a plugin author would write one: against the public contract in
``hicache.backends.base``, with no access to hicache internals. Everything happens in one
event-loop step per call (no ``await`` inside), so no lock is needed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from hicache.backends.base import MISS, Capabilities, ObjectInfo, StorageBackend, copy_if_fits

__all__ = ["ExampleBackend", "ExampleConfig"]


@dataclass(frozen=True, slots=True)
class ExampleConfig:
    """``example://label``: the label only names the store; every open starts empty."""

    label: str = "default"


class ExampleBackend(StorageBackend):
    """A dict of ``key -> (bytes, mtime)``, gone at close (not persistent, not shared)."""

    name = "example"
    url_schemes = ("example",)
    url_parts = frozenset({"host"})  # example://label; a path is refused by the base class
    capabilities = Capabilities()
    config_type = ExampleConfig

    def __init__(self, config: ExampleConfig | None = None) -> None:
        super().__init__()
        self.config = config or ExampleConfig()
        self._data: dict[str, tuple[bytes, float]] = {}

    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        return {"label": netloc} if netloc else {}

    async def _exists(self, keys: list[str]) -> list[bool]:
        return [k in self._data for k in keys]

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        out = []
        for key, segs in zip(keys, buffers):
            entry = self._data.get(key)
            # The size is reported even when it does not fit: the caller retries with room.
            out.append(MISS if entry is None else copy_if_fits(entry[0], segs))
        return out

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        for key, segs in zip(keys, values):
            self._data[key] = (b"".join(segs), time.time())  # a copy: the caller reuses segs
        return [True] * len(keys)

    async def _delete(self, keys: list[str]) -> list[bool]:
        return [self._data.pop(k, None) is not None for k in keys]

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        for key, (data, mtime) in list(self._data.items()):
            if key.startswith(prefix):
                yield ObjectInfo(key, len(data), mtime)

    async def _stats(self) -> dict[str, int | float]:  # optional: the base has counters
        return {"objects": len(self._data)}

    async def _close(self) -> None:
        self._data.clear()
