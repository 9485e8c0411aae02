"""The backend conformance suite, shipped for every backend and plugin author.

Subclass :class:`BackendConformanceTests` in a test module and implement ``open_backend``::

    class TestMyBackend(BackendConformanceTests):
        async def open_backend(self, location):
            return await MyBackend.open(MyConfig(root=str(location)))

``location`` is a fresh directory per test; opening the same location again must give the same
store (that is how persistence is checked when ``capabilities.persistent`` is true). Override
``cleanup_backend`` for stores that live outside ``location`` (shared memory segments).
Needs pytest and pytest-asyncio (``pip install 'hicache[test]'``).
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hicache.backends.base import MISS, StorageBackend

__all__ = ["BackendConformanceTests"]


class BackendConformanceTests:
    """The contract of :class:`StorageBackend`, checked against ground truth."""

    #: Size of the large-object round trip; lower it only for stores with a documented cap.
    large_object_bytes: int = 64 << 20

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        raise NotImplementedError("subclasses open their backend at `location`")

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        """Remove anything the store left outside ``location``; the default does nothing."""

    @pytest_asyncio.fixture
    async def location(self, tmp_path: pathlib.Path) -> AsyncIterator[pathlib.Path]:
        path = tmp_path / "store"
        path.mkdir()
        yield path
        await self.cleanup_backend(path)

    @pytest_asyncio.fixture
    async def backend(self, location: pathlib.Path) -> AsyncIterator[StorageBackend]:
        opened = await self.open_backend(location)
        yield opened
        await opened.close()

    @pytest.mark.asyncio
    async def test_round_trip(self, backend: StorageBackend) -> None:
        payload = bytes(range(256)) * 17
        assert await backend.put(["k1"], [payload]) == [True]
        buf = bytearray(len(payload))
        assert await backend.get_into(["k1"], [buf]) == [len(payload)]
        assert bytes(buf) == payload

    @pytest.mark.asyncio
    async def test_miss(self, backend: StorageBackend) -> None:
        buf = bytearray(8)
        assert await backend.get_into(["absent"], [buf]) == [MISS]
        assert await backend.exists(["absent"]) == [False]
