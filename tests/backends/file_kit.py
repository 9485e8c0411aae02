"""Helpers for the file backend's tests: opening a store, where an object lives, raw reads."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from typing import Any

import xxhash

from hicache.backends.file import FileBackend, FileConfig


async def open_file(root: pathlib.Path, **options: Any) -> FileBackend:
    return await FileBackend.open(FileConfig(root=str(root), **options))


def files_under(root: pathlib.Path) -> list[str]:
    """Every regular file below ``root``, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def object_path(root: pathlib.Path, key: str) -> pathlib.Path:
    h = xxhash.xxh3_64_hexdigest(key.encode())
    return root / h[0:2] / h[2:4] / key


async def put_in_order(backend: FileBackend, keys: list[str], value: bytes) -> None:
    """One call per key: the keys of one batch are written in parallel, in no set order."""
    for key in keys:
        assert await backend.put([key], [value]) == [True]


async def read(backend: FileBackend, key: str, size: int) -> bytes | None:
    buf = bytearray(size)
    (n,) = await backend.get_into([key], [buf])
    return None if n < 0 else bytes(buf[:n])


async def opened_store(tmp_path: pathlib.Path) -> AsyncIterator[FileBackend]:
    """A store under ``tmp_path``, closed afterwards: ``store = pytest.fixture(opened_store)``."""
    backend = await open_file(tmp_path / "store")
    yield backend
    await backend.close()
