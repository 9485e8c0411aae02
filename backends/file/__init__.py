"""``file://``: one file per object under a root directory (see :mod:`.backend`).

Modules: ``backend`` (the backend: opening, writes, deletes, its index and eviction),
``config`` (its options), ``reads`` (gets and peeks, O_DIRECT), ``maintenance`` (what the
operating tools check a backend for: whole-store reads, temporary files), ``store_maintenance``
(this backend's side of it), ``tree`` (walking the directories without following links),
``scan`` (listings and whole-tree reads), ``io`` (vector reads and writes) and ``bulk_read``
(whole-store reads in threads or processes).
"""

from hicache.backends.file.backend import FileBackend, FileConfig

__all__ = ["FileBackend", "FileConfig"]
