"""Raw hooks for conformance classes whose store is a :class:`MemoryBackend` (maybe wrapped).

The memory backend's storage is its dict of objects: these read and write it directly.
"""

from __future__ import annotations

import time

from hicache.backends.base import StorageBackend
from hicache.backends.memory import MemoryBackend


def memory_of(backend: StorageBackend) -> MemoryBackend:
    """The memory backend at the bottom of a stack of wrappers."""
    while not isinstance(backend, MemoryBackend):
        backend = backend.inner  # type: ignore[attr-defined]
    return backend


def read_memory_raw(backend: StorageBackend, key: str) -> bytes | None:
    entry = memory_of(backend)._objects.get(key)
    return None if entry is None else bytes(entry[0])


def write_memory_raw(backend: StorageBackend, key: str, data: bytes) -> None:
    memory = memory_of(backend)
    memory._drop(key)  # keeps the byte count right, as a put would
    memory._objects[key] = (bytearray(data), time.time())
    memory._used += len(data)
