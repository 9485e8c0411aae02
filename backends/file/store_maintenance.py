"""The ``file`` backend's side of the operating tools' capabilities (:mod:`.maintenance`):
whole-store reads (``BulkReader``) and writers' temporary files (``TempFileOwner``).

A mixin of :class:`~hicache.backends.file.backend.FileBackend`, kept apart so that the backend's
own module holds the object operations. Every walk here goes through :mod:`.scan`, which never
follows a link below the root.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from hicache.backends.file.bulk_read import read_store
from hicache.backends.file.maintenance import (
    TEMP_GRACE_S,
    ObjectBatches,
    ObjectCheck,
    TempFile,
)
from hicache.backends.file.scan import (
    remove_if_stale,
    root_temp_files,
    temp_files_under,
    top_dirs,
)

__all__ = ["StoreMaintenance"]

T = TypeVar("T")


class StoreMaintenance:
    """``read_all``, ``scan_temp_files`` and ``remove_temp_files`` over ``_root``."""

    # Provided by the backend (and its base class).
    _root: str
    _bump: Callable[..., None]
    _warn_once: Callable[[str, str], None]
    _check_open: Callable[[], None]
    _check_writable: Callable[[str], None]

    async def read_all(
        self, prefix: str, check: ObjectCheck[T], *, threads: int = 2, processes: int = 0
    ) -> ObjectBatches[T]:
        """``check(key, data)`` for every object, one thread hop per few top-level directories.

        Each worker has its own buffer; like ``peek``, these reads leave the eviction order
        alone. One thread runs until the objects prove large: a small object's cost is mostly
        Python (the check, the walk), which the GIL serialises, and two threads handing it back
        and forth are slower than one; a large object's copy and checksum run without it. Small
        objects go to up to ``processes`` worker processes instead, when ``check`` can be sent
        to them (a module-level function) and the store is big enough to pay for starting them.
        """
        self._check_open()
        names = await asyncio.to_thread(top_dirs, self._root)
        outcomes = read_store(self._root, names, prefix, check, threads, processes)
        async with contextlib.aclosing(outcomes) as batches:
            async for results, _, failed in batches:
                if failed:
                    self._bump("read_errors", failed)
                    self._warn_once("read", f"{failed} objects could not be read")
                yield results

    async def scan_temp_files(self) -> AsyncIterator[TempFile]:
        """Every writer's temporary file, with its age; one thread hop per top directory."""
        self._check_open()
        for info in await asyncio.to_thread(root_temp_files, self._root):  # open()'s probe
            yield info
        for top in await asyncio.to_thread(top_dirs, self._root):
            for info in await asyncio.to_thread(temp_files_under, self._root, top):
                yield info

    async def remove_temp_files(self, min_age_s: float = TEMP_GRACE_S) -> list[TempFile]:
        """Remove temporary files not written for ``min_age_s`` seconds; those removed."""
        self._check_writable("removing temporary files")
        removed: list[TempFile] = []
        async for info in self.scan_temp_files():
            if info.age_s >= min_age_s and await asyncio.to_thread(
                remove_if_stale, self._root, info.path, min_age_s
            ):
                removed.append(info)
        return removed
