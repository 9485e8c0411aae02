"""Helpers for driving LMCache 0.5.6's own storage code (CPU only) against the hicache plugin.

LMCache is configured the way a user would (``remote_storage_plugins`` + ``extra_config``),
and its own ``RemoteBackend``, ``StorageManager`` and ``LMCacheEngine`` load the plugin. The
one stand-in is the GPU side: :class:`CopyGPUConnector` copies between a CPU tensor and
LMCache's memory objects, where a serving engine would copy from its paged GPU KV.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from hicache.integrations.lmcache import HiCacheConnector

LAYERS, CHUNK, HEADS, HEAD_DIM = 2, 16, 2, 8
MODEL = "org/Model-1.5"  # a '/' and a '.': characters hicache keys do not allow as they are


def plugin_extra(url: str, plugin: str = "hicache") -> dict[str, Any]:
    """The ``extra_config`` entries that load the plugin, as docs/engines.md gives them."""
    return {
        f"remote_storage_plugin.{plugin}.module_path": "hicache.integrations.lmcache",
        f"remote_storage_plugin.{plugin}.class_name": "LMCacheConnectorAdapter",
        f"remote_storage_plugin.{plugin}.url": url,
    }


def lmcache_config(url: str, **overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.02,
        "remote_serde": "naive",
        "remote_storage_plugins": ["hicache"],
        "extra_config": plugin_extra(url),
    }
    fields.update(overrides)
    return LMCacheEngineConfig.from_defaults(**fields)


def lmcache_metadata(dtype: torch.dtype = torch.bfloat16, heads: int = HEADS) -> Any:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(LAYERS, 2, CHUNK, heads, HEAD_DIM),
        chunk_size=CHUNK,
    )


def chunk_key(chunk_hash: int, dtype: torch.dtype = torch.bfloat16, **tags: str) -> Any:
    configs = {f"lmcache.tag.{k}": v for k, v in tags.items()} or None
    return CacheEngineKey(MODEL, 1, 0, chunk_hash, dtype, request_configs=configs)


def fill(obj: MemoryObj, seed: int) -> torch.Tensor:
    """Random KV in ``obj``; a copy of it to compare with later."""
    tensor = obj.tensor
    assert tensor is not None
    gen = torch.Generator().manual_seed(seed)
    tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    return tensor.clone()


def wait_until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """LMCache writes to remote storage in the background; wait for ``done()``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("LMCache's background writes did not finish in time")
        time.sleep(0.01)


def wait_stored(remote: Any, keys: Sequence[Any]) -> None:
    """Wait for LMCache's background writes of ``keys`` to its remote backend.

    Not ``remote.put_tasks``: LMCache's batched put path never adds to it
    (``RemoteBackend.batched_submit_put_task``), so it is empty while writes are in flight.
    """
    wait_until(lambda: remote.batched_contains(list(keys)) == len(keys))


def connector_of(remote: Any) -> HiCacheConnector:
    """The plugin's connector inside LMCache's RemoteBackend (under its instrumentation)."""
    inner = remote.connection.getWrappedConnector()
    assert isinstance(inner, HiCacheConnector)
    return inner


def run_on(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


class CopyGPUConnector(MockGPUConnector):  # type: ignore[misc]
    """The serving engine's side: KV lives in ``kvcaches`` ([2, layers, tokens, hidden], CPU)."""

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end, :])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(
        self, memory_objs: Sequence[MemoryObj], starts: list[int], ends: list[int], **kw: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kw)

    def batched_to_gpu(
        self, memory_objs: Sequence[MemoryObj], starts: list[int], ends: list[int], **kw: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kw)


class Node:
    """One LMCache worker's storage below the engine: its CPU backend and the remote one."""

    def __init__(self, loop: asyncio.AbstractEventLoop, config: Any, metadata: Any) -> None:
        self.metadata = metadata
        self.cpu = LocalCPUBackend(config, metadata, "cpu")
        self.remote = RemoteBackend(config, metadata, loop, self.cpu, "cpu", plugin_name="hicache")

    def allocate(self, tokens: int = CHUNK) -> MemoryObj:
        obj = self.cpu.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes())
        assert obj is not None
        return obj

    def put(self, key: Any, obj: MemoryObj) -> None:
        """LMCache's single put, waited for; ``obj`` stays the caller's."""
        self.remote.submit_put_task(key, obj).result(10)

    @property
    def connector(self) -> HiCacheConnector:
        return connector_of(self.remote)
