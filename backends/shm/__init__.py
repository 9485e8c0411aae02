"""``shm://name``: a bounded LRU store in one shared-memory segment per name (see :mod:`.backend`).

Modules: ``backend`` (the backend and its read and write protocol), ``layout`` (the segment
file, its header and locks), ``index`` (the shared index and block allocator) and ``copies``
(copy planning: scatter-gather pieces, and splitting a batch across threads).
"""

from hicache.backends.shm.backend import SharedMemoryBackend, SharedMemoryConfig

__all__ = ["SharedMemoryBackend", "SharedMemoryConfig"]
