"""The ``file`` backend's options (see :mod:`.backend` for what they do)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hicache.errors import ConfigError

__all__ = ["FileConfig"]


@dataclass(frozen=True, slots=True)
class FileConfig:
    """Options of ``file:///path?fsync=true&o_direct=true&max_bytes=10G&io_threads=4``
    (and ``thread_min_bytes=4M``)."""

    root: str
    fsync: bool = False  # fsync each file before its rename and the directory after it
    o_direct: bool = False  # O_DIRECT reads into one 4096-aligned segment; else buffered, counted
    max_bytes: int | None = None  # size cap of this process's view of the store (LRU eviction)
    io_threads: int = 4  # a batch is split into up to this many chunks, one thread each
    # ... each of at least this many bytes (a key-only call counts 64 KiB a key): a thread per
    # chunk of small pages costs more CPU in hand-offs and GIL waits than it saves.
    thread_min_bytes: int = 4 << 20
    read_only: bool = False  # open an existing store and never write to it (the cap is not kept)

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ConfigError("FileConfig.root must be a non-empty path")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(f"FileConfig.max_bytes must be positive, got {self.max_bytes}")
        if self.io_threads <= 0:
            raise ConfigError(f"FileConfig.io_threads must be positive, got {self.io_threads}")
        if self.thread_min_bytes <= 0:
            raise ConfigError(
                f"FileConfig.thread_min_bytes must be positive, got {self.thread_min_bytes}"
            )
        # Absolute once and for all: a later chdir in the process must not move the store.
        object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(self.root)))
