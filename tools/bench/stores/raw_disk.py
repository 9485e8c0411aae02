"""The raw baseline of ``hicache bench backends --backend disk``: pwritev/preadv on one file.

The disk backend appends each batch of records to a large segment file with one ``pwritev``
from the callers' buffers and reads records back with ``preadv`` into them. The baseline is
the same system calls on one plain file, without record headers, keys, checksums, logs or an
index:

- put: each object is one ``pwritev`` of its row (object ``i`` at ``i * object_bytes``), a
  batch of 32 then ``fdatasync`` when the backend syncs its writes (``fsync=true``).
- get: each object is one ``preadv`` into its destination row (touched before the timing, as
  an engine's pooled buffers are).

What is fair about the file: the backend appends every put at fresh offsets of segments it
allocates ahead (a log-structured store writes new blocks by design), so each round's first
put batch here starts a new file, allocated to the whole round (``posix_fallocate``, timed, as
the backend's segment allocation is), and the round's puts fill it. The files of as many
rounds as the backend's capacity holds (at least ``KEEP_ROUNDS``) are kept and older ones
unlinked, as the backend keeps its newest segments and reclaims older ones: both sides then
write into new page-cache pages in every timed put, and reuse pages freed by their deletions
from about the same round on. (Keeping fewer rounds than the store holds gave the raw side
pages freed a few rounds earlier while the store still wrote into pages never used, and the
2 MiB put ratio went from 0.17 to 10 within one run.) That matters on this VM, where a page
the guest never touched costs a hypervisor fault: the same loop ran from 340 to 4,600 us per
2 MiB object, round to round, by that alone. Overwriting pages the cache already holds is a
different, cheaper operation (7.4 GB/s for 2 MiB writes here, in a round where appends into a
growing file ran at 0.45 GB/s and into an allocated file at 6.1).
Gets read the round's file.

The engine benchmarks' floor is :mod:`.floor`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["KEEP_ROUNDS", "raw_baseline"]

KEEP_ROUNDS = 3  # the fewest rounds kept (the bench's disk capacity holds three copies at least)

BatchMove = Callable[[Any, int, int], None]


def raw_baseline(backend: Any, scratch: str, work: Any) -> tuple[BatchMove, BatchMove]:
    """(put, get) batch movers over ``scratch/raw-disk.data``, one file sized for every object."""
    rows, row_bytes = (int(n) for n in work.source.shape)
    fsync = bool(getattr(getattr(backend, "config", None), "fsync", False))
    rounds = itertools.count()
    capacity = getattr(getattr(backend, "config", None), "capacity", None)
    keep = max(KEEP_ROUNDS, int(capacity or 0) // (rows * row_bytes))
    state = {"fd": _fresh_file(os.path.join(scratch, "raw-disk.0"), rows * row_bytes)}

    def put(w: Any, lo: int, hi: int) -> None:
        if lo == 0:  # a new round: a new file, as the backend writes into new segments
            os.close(state["fd"])
            number = next(rounds) + 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(scratch, f"raw-disk.{number - keep}"))
            path = os.path.join(scratch, f"raw-disk.{number}")
            state["fd"] = _fresh_file(path, rows * row_bytes)
        fd = state["fd"]
        for j in range(lo, hi):  # one call an object, as a store that writes each one must
            _pwritev_all(fd, [memoryview(w.source[j])], j * row_bytes)
        if fsync:
            os.fdatasync(fd)

    def get(w: Any, lo: int, hi: int) -> None:
        fd = state["fd"]
        for j in range(lo, hi):
            got = os.preadv(fd, [w.dest[j]], j * row_bytes)
            if got != row_bytes:  # only past the end of the file, which a bug would take
                raise RuntimeError(f"raw disk baseline: read {got} of {row_bytes} bytes")

    # Closed when the benchmark drops the callables (or at exit).
    weakref.finalize(put, lambda: os.close(state["fd"]))
    return put, get


def _fresh_file(path: str, nbytes: int) -> int:
    """A new file at ``path``, allocated to ``nbytes``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


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
