"""The ``open`` of backends whose setup blocks: build the object, then prepare it in a thread.

Several backends (file, disk, 3fs, nixl) open the same way: the constructor only stores the
config, and the real work of opening (creating directories, replaying an index, starting an
agent) blocks on the filesystem or a library. That work runs on a worker thread so that opening
a store does not stall the event loop, and the serving loop on it.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any, TypeVar

from hicache.backends.base import StorageBackend

__all__ = ["PreparedInThread"]

P = TypeVar("P", bound="PreparedInThread")


class PreparedInThread(StorageBackend):
    """A backend opened as ``cls(config)`` and then :meth:`_prepare` on a worker thread."""

    @classmethod
    async def open(cls: type[P], config: Any) -> P:
        backend = cls(config)  # type: ignore[call-arg]  # each subclass takes its config
        await asyncio.to_thread(backend._prepare)
        return backend

    @abc.abstractmethod
    def _prepare(self) -> None:
        """The blocking part of opening, run on a worker thread; raises what open raises."""
