"""``disk://``: a log-structured local store; see :mod:`.backend`."""

from hicache.backends.disk.backend import DiskBackend
from hicache.backends.disk.config import DiskConfig

__all__ = ["DiskBackend", "DiskConfig"]
