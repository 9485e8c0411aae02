"""Storage backends.

The contract is :mod:`.base` (with the buffer helpers of :mod:`.segments`); :mod:`.registry`
turns names and URLs into backends; :mod:`.testing` is the conformance suite. ``memory`` is one
module; a backend of several modules is a subpackage whose ``__init__`` exports the backend and
its config: ``file``, ``shm``, ``fsspec``, ``mooncake``, ``nixl``, ``hf3fs``, ``redis``.
Wrappers (faults, latency, a thread of its own) are in :mod:`.wrappers`.
"""

from hicache.backends.base import Capabilities, ObjectInfo, StorageBackend
from hicache.backends.registered_memory import MemoryRegistrar
from hicache.backends.registry import (
    get_backend_class,
    list_backends,
    open_backend,
    register_backend,
)

__all__ = [
    "Capabilities",
    "MemoryRegistrar",
    "ObjectInfo",
    "StorageBackend",
    "get_backend_class",
    "list_backends",
    "open_backend",
    "register_backend",
]
