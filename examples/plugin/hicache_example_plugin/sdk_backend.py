"""``example-sdk://endpoint``: a backend over a blocking client library (:mod:`.sdk`).

A synchronous SDK called straight from ``async def`` would stall the event loop, and the serving
loop on it, for every request. So each call hands its whole batch to one worker thread with
:func:`asyncio.to_thread` (one thread hop per batch, not per key) and the loop stays free.

The caller's buffers never reach the thread. ``put`` copies the segments into ``bytes`` before
the hop, and ``get_into`` copies the returned bytes into the segments after it, on the loop.
This matters because a thread cannot be stopped: when the caller is cancelled, ``to_thread``
returns at once while the thread runs on, and the contract lets the caller reuse its buffers as
soon as the call is over. (hicache's own blocking backends keep the buffers and wait for their
threads instead, to save the copy; ``hicache.backends.wrappers.ThreadedBackend`` is the other
way out, for a backend whose ``async`` methods block.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from hicache.backends.base import MISS, Capabilities, ObjectInfo, StorageBackend, copy_if_fits
from hicache.errors import ConfigError
from hicache_example_plugin.sdk import BlockingKVClient

__all__ = ["ExampleSdkBackend", "ExampleSdkConfig"]


@dataclass(frozen=True, slots=True)
class ExampleSdkConfig:
    """``example-sdk://endpoint?latency_s=0.001``."""

    endpoint: str = "default"
    latency_s: float = 0.0  # how long each SDK call blocks (a stand-in for the network)

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ConfigError("ExampleSdkConfig.endpoint must be non-empty")
        if not self.latency_s >= 0:  # written so that NaN fails too
            raise ConfigError(f"ExampleSdkConfig.latency_s must be >= 0, got {self.latency_s}")


class ExampleSdkBackend(StorageBackend):
    """Objects on a :class:`BlockingKVClient` server; every SDK call runs in a worker thread."""

    name = "example-sdk"
    url_schemes = ("example-sdk",)
    url_parts = frozenset({"host"})  # the endpoint
    # The server outlives a client but not the process: shared by opens of one endpoint in this
    # process only, and not persistent.
    capabilities = Capabilities(persistent=False, shared_across_processes=False, listable=True)
    config_type = ExampleSdkConfig

    def __init__(self, config: ExampleSdkConfig, client: BlockingKVClient) -> None:
        super().__init__()
        self.config = config
        self._client = client

    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        return {"endpoint": netloc} if netloc else {}

    @classmethod
    async def open(cls, config: ExampleSdkConfig) -> ExampleSdkBackend:
        # Connecting blocks too: in a thread, like every other SDK call.
        client = await asyncio.to_thread(BlockingKVClient, config.endpoint, config.latency_s)
        return cls(config, client)

    async def _exists(self, keys: list[str]) -> list[bool]:
        return await asyncio.to_thread(lambda: [self._client.exists(k) for k in keys])

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        found = await asyncio.to_thread(lambda: [self._client.get(k) for k in keys])
        # Copied back on the loop, while the caller still waits for this call.
        return [
            MISS if data is None else copy_if_fits(data, segs)
            for data, segs in zip(found, buffers, strict=True)
        ]

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        payloads = [b"".join(segs) for segs in values]  # copied here, before the hop

        def put_all() -> list[bool]:
            for key, data in zip(keys, payloads, strict=True):
                self._client.put(key, data)
            return [True] * len(keys)

        return await asyncio.to_thread(put_all)

    async def _delete(self, keys: list[str]) -> list[bool]:
        return await asyncio.to_thread(lambda: [self._client.delete(k) for k in keys])

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        for obj in await asyncio.to_thread(self._client.list, prefix):
            yield ObjectInfo(obj.key, obj.size, obj.mtime)

    async def _close(self) -> None:
        await asyncio.to_thread(self._client.close)
