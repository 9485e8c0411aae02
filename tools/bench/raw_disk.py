"""The raw baseline of ``hicache bench backends --backend disk``: pwritev/preadv on one file.

The disk backend appends each batch of records to a large segment file with one ``pwritev``
from the callers' buffers and reads records back with ``preadv`` into them. The baseline is
the same system calls on one plain file, without record headers, keys, checksums, logs or an
index:

- put: each batch of 32 objects is one ``pwritev`` of their rows at consecutive offsets
  (object ``i`` at ``i * object_bytes``), then ``fdatasync`` when the backend syncs its writes
  (``fsync=true``).
- get: each object is one ``preadv`` into its destination row.

What is fair about the file: it is allocated to its full size here (``posix_fallocate``), and
the bench's untimed warm-up pass writes every byte of it once, so the timed rounds overwrite
blocks that are allocated and written, through pages already in the page cache: no block
allocation, no unwritten-extent conversion, no file growth, no new page-cache page in any
timed step. That makes the baseline the floor of moving these bytes through this
filesystem, which is what a baseline is for. The backend does not get that on later rounds:
every put appends its records at fresh offsets of its segments (a log-structured store writes
new blocks by design, and under its capacity reclaims whole old segments, in the put that
needs the room), so part of any put gap, wall time and CPU alike, is the allocation the
backend pays each round: new page-cache pages (which on a VM may be guest pages never
touched before, a hypervisor fault each), and the blocks, which ext4's delayed allocation
mostly assigns at writeback, run untimed here (``os.sync`` before every step). On this 2-core
VM, plain ``pwritev`` of 64 KiB objects at fresh offsets ran from as fast as an overwrite to
20 times slower from one round to the next.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["raw_baseline"]

BatchMove = Callable[[Any, int, int], None]


def raw_baseline(backend: Any, scratch: str, work: Any) -> tuple[BatchMove, BatchMove]:
    """(put, get) batch movers over ``scratch/raw-disk.data``, one file sized for every object."""
    rows, row_bytes = (int(n) for n in work.source.shape)
    fsync = bool(getattr(getattr(backend, "config", None), "fsync", False))
    path = os.path.join(scratch, "raw-disk.data")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, rows * row_bytes)
    except OSError:
        os.close(fd)
        raise

    def put(w: Any, lo: int, hi: int) -> None:
        _pwritev_all(fd, [memoryview(w.source[j]) for j in range(lo, hi)], lo * row_bytes)
        if fsync:
            os.fdatasync(fd)

    def get(w: Any, lo: int, hi: int) -> None:
        for j in range(lo, hi):
            got = os.preadv(fd, [w.dest[j]], j * row_bytes)
            if got != row_bytes:  # only past the end of the file, which a bug would take
                raise RuntimeError(f"raw disk baseline: read {got} of {row_bytes} bytes")

    # Closed when the benchmark drops the callables (or at exit).
    weakref.finalize(put, os.close, fd)
    return put, get


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` back to back at ``offset``: one ``pwritev`` unless it comes back short
    (Linux moves at most about 2 GiB a call), then the rest from where it stopped."""
    while views:
        done = os.pwritev(fd, views, offset)
        if done <= 0:
            raise OSError(f"raw disk baseline: pwritev wrote {done} bytes")
        offset += done
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views = views[1:]
        if views and done:
            views[0] = views[0][done:]
