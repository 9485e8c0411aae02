"""A wrapper that runs its inner backend on an event loop of its own, in a thread of its own.

For a backend whose "async" methods block (a plugin that calls a synchronous client straight
from ``async def``): every call is handed to the backend's own loop, so the caller's loop, and
the serving loop on it, never stall behind it. The thread is not a daemon: :meth:`close` stops
the loop and joins it, and an error in the thread comes back to the caller of that call. A
cancelled call returns once the inner call has ended, which it lets run: like a thread, the
inner call may be using the caller's buffers until then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from hicache.backends._io_threads import outlive_cancel
from hicache.backends.base import ObjectInfo, StorageBackend
from hicache.backends.wrappers.base import WrapperBackend

__all__ = ["ThreadedBackend"]

T = TypeVar("T")


class _LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=False)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    async def call(self, coro: Awaitable[T]) -> T:
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(
            coro,  # type: ignore[arg-type]
            self.loop,
        )
        return await outlive_cancel(asyncio.wrap_future(future))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


class ThreadedBackend(WrapperBackend):
    """Forwards every operation to ``inner`` on its own loop thread; open it with :meth:`open_url`.

    Unlike other wrappers, ``stats()`` reports the inner backend's stats as they are, not under
    ``inner.``: this wrapper changes where calls run, not what they do, so its caller reads the
    same names as with the backend unwrapped.
    """

    name = "threaded"

    def __init__(self, inner: StorageBackend, loop_thread: _LoopThread) -> None:
        super().__init__(inner)
        self._thread = loop_thread

    @classmethod
    async def open_url(cls, url: str, **config: Any) -> ThreadedBackend:
        """Start a loop thread, open ``url`` (as :func:`open_backend` would) on it, wrap it."""
        from hicache.backends.registry import open_backend

        thread = _LoopThread(f"hicache-backend:{url.split('://', 1)[0]}")
        try:
            inner = await thread.call(open_backend(url, **config))
        except BaseException:
            thread.stop()
            raise
        return cls(inner, thread)

    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self._thread.call(self.inner.exists(keys))

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        return await self._thread.call(self.inner.get_into(keys, buffers))

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        return await self._thread.call(self.inner.put(keys, values))

    async def _delete(self, keys: list[str]) -> list[bool]:
        return await self._thread.call(self.inner.delete(keys))

    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        return await self._thread.call(self.inner.peek(keys, nbytes))

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        async def collect() -> list[ObjectInfo]:
            return [info async for info in self.inner.scan(prefix)]

        for info in await self._thread.call(collect()):
            yield info

    async def _stats(self) -> dict[str, int | float]:
        return await self._thread.call(self.inner.stats())

    async def _close(self) -> None:
        try:
            await self._thread.call(self.inner.close())
        finally:
            self._thread.stop()
