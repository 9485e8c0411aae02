"""The example plugin's conformance tests: hicache's whole backend contract, per backend.

Install the plugin, then run these tests::

    pip install -e examples/plugin
    pytest examples/plugin/tests

Each class subclasses :class:`BackendConformanceTests` and says how to open its backend. The
raw hooks (optional) let the suite compare what the API reports with what is really stored.
"""

from __future__ import annotations

import hashlib
import pathlib

from hicache_example_plugin import (
    BlockingKVClient,
    ExampleBackend,
    ExampleConfig,
    ExampleSdkBackend,
    ExampleSdkConfig,
)

from hicache.backends.base import StorageBackend
from hicache.backends.testing import BackendConformanceTests


class TestExampleBackend(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await ExampleBackend.open(ExampleConfig(label=location.name))

    # Raw hooks: the backend's storage is its dict.
    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        assert isinstance(backend, ExampleBackend)
        entry = backend._data.get(key)
        return None if entry is None else entry[0]

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        assert isinstance(backend, ExampleBackend)
        backend._data[key] = (bytes(data), 0.0)


def endpoint_for(location: pathlib.Path) -> str:
    """One server per test: the same location reopens the same store."""
    return "conformance-" + hashlib.sha1(str(location).encode()).hexdigest()[:16]


class TestExampleSdkBackend(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await ExampleSdkBackend.open(ExampleSdkConfig(endpoint=endpoint_for(location)))

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        BlockingKVClient.drop_endpoint(endpoint_for(location))  # the store outlives the backend

    # Raw hooks: a client of the SDK's own, as another program using the same server would be.
    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        assert isinstance(backend, ExampleSdkBackend)
        return BlockingKVClient(backend.config.endpoint).get(key)

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        assert isinstance(backend, ExampleSdkBackend)
        BlockingKVClient(backend.config.endpoint).put(key, data)
