"""The page-cache floor of the engine benchmarks (``bench sglang``, ``bench lmcache``).

A floor side does what any store that keeps pages in files must do, and nothing else: each
page written with one ``pwritev`` into a new file allocated for the round, and read back with
one ``preadv`` straight into a destination buffer that is already touched (as an engine's
pinned or pooled host buffer is), no headers, checksums, index or files per page. Its time
over a store's, in the same round, is about the best ratio a store that copies pages through
the page cache can reach in that memory state.

Two floors run in each rotation, so the thread count of a store is judged against measured
figures, not a default: a single stream (one thread, pages in order) and ``threads`` streams
(pages claimed one at a time by ``threads`` threads, as the disk backend shares a large
batch; :func:`machine_threads` by default).

The memory state every side of a round meets is made the same by :func:`settle_memory`, run
before each side's put: on a VM that reports freed pages to its host (virtio-balloon free page
reporting, on here), a page-cache page the store allocates may come back from the host, which
costs a fault per 4 KiB, or may be one the guest freed a moment ago, which costs nothing; which
one a side gets depends on what ran before it. Writing, then freeing, as many bytes as the side
is about to store just before it starts hands every side pages the guest has just touched (a
host that has run a while, with every page of its memory in use once, is in that state).
Every round's file is kept until :meth:`PageCacheFloor.close`, as the stores beside it keep
every round's pages.

:func:`settle_memory` also writes back what earlier sides left dirty (``sync``) before it: a
run keeps several GB of earlier rounds' pages, and once they pass the kernel's dirty limits the
kernel writes them back while the next side stores, and throttles it. Which side met that was
chance: 64 pages of 8 MiB into one allocated file ran at 0.86-7.3 GB/s with earlier rounds'
files left dirty, and at 6.7-7.9 (one round of 2.2) with each round's removed; ``disk://``'s
put of the same pages at 1.5-3.7 and 6.9-7.3 (one of 0.66) (scratch scripts, five and six
rounds).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hicache.machine import machine_threads
from hicache.tools.bench.rounds import gb_s, paired_ratio

__all__ = ["PageCacheFloor", "floor_figures", "floor_sides", "settle_memory"]

_SETTLE_CHUNK = 8 << 20


def settle_memory(scratch: str, nbytes: int) -> None:
    """Write back every dirty page (``sync``), then write ``nbytes`` into a scratch file in
    ``scratch`` and unlink it: its page-cache pages go back to the free lists touched by the
    guest, the pages the next writer allocates first (see the module docstring)."""
    os.sync()
    path = os.path.join(scratch, "settle.tmp")
    zeros = memoryview(bytearray(min(nbytes, _SETTLE_CHUNK)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, zeros[: min(zeros.nbytes, nbytes - done)], done)
    finally:
        os.close(fd)
        os.unlink(path)


class PageCacheFloor:
    """``pages`` pages of ``page_bytes`` random bytes through the page cache and back, by
    ``threads`` threads, timed; from and into memory of its own, touched before it is timed."""

    def __init__(self, scratch: str, pages: int, page_bytes: int, threads: int = 1) -> None:
        import numpy as np

        self.scratch = scratch
        self.threads = threads
        self.page_bytes = page_bytes
        self._source = _page_aligned(pages, page_bytes)
        self._source[:] = np.random.default_rng().integers(0, 256, (pages, page_bytes), np.uint8)
        self._target = _page_aligned(pages, page_bytes)
        self._target.fill(1)  # touched
        self._rounds = itertools.count()
        self._pool = ThreadPoolExecutor(threads, "floor") if threads > 1 else None

    def round_trip(self) -> tuple[float, float]:
        """(put, get) seconds: each page written with one ``pwritev``, then each read into the
        target with one ``preadv``; the bytes read are compared with the pages, untimed."""
        number = next(self._rounds)
        self._target.fill(0)
        pages = [memoryview(row) for row in self._source]
        targets = [memoryview(row) for row in self._target]
        path = os.path.join(self.scratch, f"floor-{self.threads}.{number}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self._source.nbytes)
            settle_memory(self.scratch, self._source.nbytes)
            started = time.perf_counter()
            self._each(lambda i: os.pwritev(fd, [pages[i]], i * self.page_bytes), len(pages))
            put_s = time.perf_counter() - started
            started = time.perf_counter()
            got = self._each(lambda i: os.preadv(fd, [targets[i]], i * self.page_bytes), len(pages))
            get_s = time.perf_counter() - started
        finally:
            os.close(fd)
        if got != self._source.nbytes or not (self._source == self._target).all():
            raise RuntimeError("page-cache floor: the bytes read back differ from those written")
        return put_s, get_s

    def _each(self, move: Any, count: int) -> int:
        """``move(i)`` for every page ``i``, the pages claimed one at a time by the threads;
        the bytes moved."""
        if self._pool is None:
            return sum(move(i) for i in range(count))
        claims = itertools.count()  # next() of a count is atomic under the GIL

        def stream() -> int:
            moved = 0
            for i in claims:
                if i >= count:
                    return moved
                moved += move(i)
            return moved

        return sum(self._pool.map(lambda _: stream(), range(self.threads)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        prefix = f"floor-{self.threads}."
        for name in os.listdir(self.scratch):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.scratch, name))


def _page_aligned(pages: int, page_bytes: int) -> Any:
    """A ``pages`` x ``page_bytes`` uint8 array on page-aligned memory of its own, as engines'
    host buffers are: numpy's own allocation starts 16 bytes past a page here, and a copy
    between the page cache and memory not 64-byte aligned the same way ran at 9.5 GB/s
    where an aligned one ran at 15 (docs/BENCHMARKS.md, issue 48)."""
    import numpy as np

    region = mmap.mmap(-1, max(1, pages * page_bytes))
    return np.frombuffer(region, np.uint8, pages * page_bytes).reshape(pages, page_bytes)


def floor_sides(scratch: str, pages: int, page_bytes: int) -> dict[str, PageCacheFloor]:
    """The floors of a rotation by side name: ``floor_1`` (one stream) and ``floor_N`` (N the
    machine's threads, when it has more than one)."""
    counts = sorted({1, machine_threads()})
    return {f"floor_{n}": PageCacheFloor(scratch, pages, page_bytes, n) for n in counts}


def floor_figures(
    timings: dict[str, dict[str, list[float]]], nbytes: int, ours: str, theirs: str
) -> dict[str, Any]:
    """Each floor's throughput, its ratio over ``theirs`` (the best a page-cache store could
    reach against them), and ``ours`` over it (how close ours comes to the floor)."""
    row: dict[str, Any] = {}
    for name, floor in timings.items():
        if not name.startswith("floor_"):
            continue
        for op in ("put", "get"):
            row[f"{name}_{op}_gb_s"] = gb_s(nbytes, floor[op])
            row.update(paired_ratio(f"{name}_{op}_ratio", floor[op], timings[theirs][op]))
            row.update(paired_ratio(f"{op}_over_{name}", timings[ours][op], floor[op]))
    return row
