"""The base of every wrapper: a backend whose storage is another backend.

A wrapper is a :class:`StorageBackend` whose storage is another backend (``inner``). It forwards
every call to the inner backend's public methods, so the inner backend keeps its own counters
and checks; the wrapper's counters describe what its caller saw.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from hicache.backends.base import ObjectInfo, StorageBackend
from hicache.errors import InvalidArgumentError

__all__ = ["SleepFn", "WrapperBackend"]


SleepFn = Callable[[float], Awaitable[Any]]


class WrapperBackend(StorageBackend):
    """A transparent pass-through to ``inner``; subclasses override the calls they change.

    Capabilities are the inner backend's. ``stats()`` reports the inner backend's stats under
    ``inner.`` plus the wrapper's own (:meth:`_wrapper_stats`). ``close()`` closes ``inner``.
    """

    name = "wrapper"

    def __init__(self, inner: StorageBackend) -> None:
        if not isinstance(inner, StorageBackend):
            raise InvalidArgumentError(f"a wrapper needs a StorageBackend, not {type(inner)}")
        super().__init__()
        self.inner = inner
        self.capabilities = inner.capabilities

    @classmethod
    async def open(cls, config: Any) -> Any:
        raise InvalidArgumentError(
            f"{cls.__name__} wraps another backend: build it in code, e.g. "
            f"{cls.__name__}(inner_backend, config)"
        )

    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self.inner.exists(keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        return await self.inner.get_into(keys, buffers)

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        return await self.inner.put(keys, values)

    async def _delete(self, keys: list[str]) -> list[bool]:
        return await self.inner.delete(keys)

    def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        return self.inner.scan(prefix)

    async def _stats(self) -> dict[str, int | float]:
        merged: dict[str, int | float] = {
            f"inner.{k}": v for k, v in (await self.inner.stats()).items()
        }
        merged.update(self._wrapper_stats())
        return merged

    def _wrapper_stats(self) -> dict[str, int | float]:
        """The wrapper's own counters; none for a plain pass-through."""
        return {}

    async def _close(self) -> None:
        await self.inner.close()
