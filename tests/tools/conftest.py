"""Fixtures of the operating tools' tests: a file store, a memory store, or each in turn."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
from store_kit import StoreKit

from hicache.backends.base import StorageBackend
from hicache.backends.file import FileBackend, FileConfig
from hicache.backends.memory import MemoryBackend


@pytest.fixture
async def file_kit(tmp_path: pathlib.Path) -> AsyncIterator[StoreKit]:
    backend = await FileBackend.open(FileConfig(root=str(tmp_path / "store")))
    yield StoreKit(backend, tmp_path / "store")
    await backend.close()


@pytest.fixture
async def memory_kit() -> AsyncIterator[StoreKit]:
    backend = MemoryBackend()
    yield StoreKit(backend, None)
    await backend.close()


@pytest.fixture(params=["file", "memory"])
async def kit(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> AsyncIterator[StoreKit]:
    if request.param == "file":
        backend: StorageBackend = await FileBackend.open(FileConfig(root=str(tmp_path / "store")))
        yield StoreKit(backend, tmp_path / "store")
    else:
        backend = MemoryBackend()
        yield StoreKit(backend, None)
    await backend.close()
