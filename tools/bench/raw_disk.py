"""The raw baseline of ``hicache bench backends --backend disk``: pwritev/preadv on one file.

The disk backend appends each batch of records to a large segment file with one ``pwritev``
from the callers' buffers and reads records back with ``preadv`` into them. The baseline is
the same system calls on one plain file, without record headers, keys, checksums, logs or an
index:

- put: each batch of 32 objects is one ``pwritev`` of their rows at consecutive offsets
  (object ``i`` at ``i * object_bytes``), then ``fdatasync`` when the backend syncs its writes
  (``fsync=true``).
- get: each object is one ``preadv`` into its destination row.

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

:class:`PageCacheFloor` is the same idea for the engine benchmarks (``bench sglang``, ``bench
lmcache``): each round, the round's pages written into a new allocated file by ``pwritev``
and read back by ``preadv``, split over a few threads as the disk backend splits a large
batch, with nothing else (no files per page, headers, checksums, index); every round's file
kept until the end, as the stores compared there keep every round's pages. It is what a put
and a get cost a store that does only the page-cache copy, in the same memory state as the
stores beside it, so the engine's own store's time over the floor's is about the highest
ratio a store writing through the page cache can reach there.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hicache.backends.segments import split_iov

__all__ = ["KEEP_ROUNDS", "PageCacheFloor", "raw_baseline"]

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
        _pwritev_all(fd, [memoryview(w.source[j]) for j in range(lo, hi)], lo * row_bytes)
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


class PageCacheFloor:
    """``pages`` pages of ``page_bytes`` random bytes through the page cache and back, timed,
    from and into memory of its own; a new file in ``scratch`` each round, every one kept
    until :meth:`close`, as the engine benchmarks' stores keep every round's pages (a floor
    that freed its files would write into pages it freed while the stores write into pages
    never used: see the module docstring)."""

    def __init__(self, scratch: str, pages: int, page_bytes: int, threads: int = 4) -> None:
        import numpy as np

        self.scratch = scratch
        self.threads = threads
        self._source = np.random.default_rng().integers(0, 256, (pages, page_bytes), np.uint8)
        self._target = np.zeros_like(self._source)
        self._rounds = itertools.count()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="floor")

    def round_trip(self) -> tuple[float, float]:
        """(put, get) seconds: the pages written back to back, then read into the target;
        the bytes read are compared with the pages, untimed."""
        number = next(self._rounds)
        self._target.fill(0)
        pages = [memoryview(row) for row in self._source]
        targets = [memoryview(row) for row in self._target]
        nbytes = self._source.nbytes
        fd = _fresh_file(os.path.join(self.scratch, f"floor.{number}"), nbytes)
        # The targets have the pages' sizes, so both lists are cut at the same places.
        writes, reads = split_iov(pages, 0, self.threads), split_iov(targets, 0, self.threads)
        try:
            started = time.perf_counter()
            list(self._pool.map(lambda part: _pwritev_all(fd, part[0], part[1]), writes))
            put_s = time.perf_counter() - started
            started = time.perf_counter()
            got = sum(self._pool.map(lambda part: _preadv_all(fd, part[0], part[1]), reads))
            get_s = time.perf_counter() - started
        finally:
            os.close(fd)
        if got != nbytes or not (self._source == self._target).all():
            raise RuntimeError("page-cache floor: the bytes read back differ from those written")
        return put_s, get_s

    def close(self) -> None:
        self._pool.shutdown()
        for name in os.listdir(self.scratch):
            if name.startswith("floor."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.scratch, name))


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Read into ``views`` back to back from ``offset``; the bytes read (short at the end of
    the file only)."""
    total = 0
    for view in views:
        got = os.preadv(fd, [view], offset + total)
        total += got
        if got < view.nbytes:
            break
    return total
