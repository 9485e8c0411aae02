"""``file://``: one file per object under a root directory (see :mod:`.backend`).

Modules: ``backend`` (the backend, its index and eviction), ``io`` (vector reads and writes,
scanning, temporary files) and ``bulk_read`` (whole-store reads in threads or processes).
"""

from hicache.backends.file.backend import FileBackend, FileConfig

__all__ = ["FileBackend", "FileConfig"]
