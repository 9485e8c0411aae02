"""Registering host memory with a backend that moves data by address (Mooncake, NIXL).

The storage tier registers every buffer pages move from and to (each contiguous host pool and
its header arena) when it starts with such a backend, and unregisters them when it stops, so
L3 transfers of those pages need no staging copy. A backend that refuses a buffer still works:
that buffer's transfers are staged, and the backend counts them in ``bytes_staged``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hicache.backends.registered_memory import MemoryRegistrar
from hicache.errors import HiCacheError

__all__ = ["register_buffers", "unregister_buffers"]

logger = logging.getLogger(__name__)


def register_buffers(backend: object, buffers: Sequence[Any]) -> list[Any]:
    """Register ``buffers`` with ``backend`` if it takes registered memory; those it took."""
    if not isinstance(backend, MemoryRegistrar):
        return []
    taken = []
    for buffer in buffers:
        try:
            if backend.register_memory(buffer):
                taken.append(buffer)
        except HiCacheError as exc:
            logger.warning("L3 refused to register %d bytes (%s): staged", buffer.nbytes, exc)
    return taken


def unregister_buffers(backend: object, buffers: Sequence[Any]) -> None:
    """Undo :func:`register_buffers`; a backend that already failed is left as it is."""
    if not isinstance(backend, MemoryRegistrar):
        return
    for buffer in buffers:
        try:
            backend.unregister_memory(buffer)
        except HiCacheError as exc:
            logger.warning("L3 could not unregister host memory: %s", exc)
