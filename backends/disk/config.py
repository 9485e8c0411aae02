"""The ``disk`` backend's options (see :mod:`.backend` for what they do)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hicache.errors import ConfigError
from hicache.machine import machine_threads

__all__ = ["DEFAULT_SEGMENT_BYTES", "DiskConfig"]

DEFAULT_SEGMENT_BYTES = 256 << 20
_MIN_SEGMENT_BYTES = 64 << 10
_MAX_DEFAULT_THREADS = 8


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """Options of ``disk:///path?capacity=200G&segment_bytes=256M&fsync=true``."""

    root: str
    capacity: int | None = None  # bytes of segments the store may hold; None: unbounded
    # The segment size of a new store; an existing store keeps its own, and naming another is
    # an error (None: whatever the store has, 256 MiB for a new one).
    segment_bytes: int | None = None
    fsync: bool = False  # acknowledged puts are durable: data, then log, synced before return
    direct: bool = False  # segments read and written with O_DIRECT, through aligned staging
    # Threads that share a large batch's reads (1: none; a segment is written by one); None:
    # one per CPU this process may use, at most 8 (a copy thread per core: more only queue
    # behind each other; docs/BENCHMARKS.md has the floors by thread count).
    io_threads: int | None = None
    read_only: bool = False  # open an existing store and never write to it
    reinsert: bool = True  # objects read since they were written survive their segment's reclaim
    snapshot_records: int = 131072  # log records of this writer between two snapshots
    # A put batch of at most this many bytes is written on the caller's event loop instead
    # of a worker thread, while the page cache takes writes without waiting; a get batch of
    # at most this many is first read there from the page cache (see backend).
    inline_bytes: int = 1 << 20
    max_writers: int = 64  # processes that may write to the store at once

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ConfigError("DiskConfig.root must be a non-empty path")
        if self.segment_bytes is not None and not (
            _MIN_SEGMENT_BYTES <= self.segment_bytes < 1 << 32
        ):
            raise ConfigError(
                f"DiskConfig.segment_bytes must be from 64K to under 4G, got {self.segment_bytes}"
            )
        if self.capacity is not None and self.capacity <= 0:
            raise ConfigError(f"DiskConfig.capacity must be positive, got {self.capacity}")
        if self.io_threads is not None and not 1 <= self.io_threads <= 64:
            raise ConfigError(f"DiskConfig.io_threads must be 1 to 64, got {self.io_threads}")
        if self.inline_bytes < 0:
            raise ConfigError(f"DiskConfig.inline_bytes must be >= 0, got {self.inline_bytes}")
        if self.snapshot_records <= 0:
            raise ConfigError("DiskConfig.snapshot_records must be positive")
        if not 1 <= self.max_writers <= 999:
            raise ConfigError(f"DiskConfig.max_writers must be 1 to 999, got {self.max_writers}")
        object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(self.root)))

    @property
    def threads(self) -> int:
        """``io_threads``, or the machine's default for it."""
        return self.io_threads or min(machine_threads(), _MAX_DEFAULT_THREADS)
