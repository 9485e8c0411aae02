"""The ``3fs`` backend's raw baseline and store for ``hicache bench backends --backend 3fs``.

The baseline is the backend's I/O without the backend: ``os.pwritev``/``os.preadv`` of each
object at a fixed slot offset of a preallocated file of its own (same slot stride), each batch
of 32 split over a thread pool as large as the backend's. No index, no slot header, no
bookkeeping: what is left of the gap is the price of those. Without ``--url`` the store is a
POSIX-mode store in the scratch directory; USRBIO needs a 3FS mount (pass ``--url``).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hicache.backends.hf3fs import Hf3fsConfig

__all__ = ["provision", "raw_baseline"]

_MIN_SLOTS = 1024  # room for 512 objects of any size, each rewritten into a fresh slot


@contextlib.contextmanager
def provision(scratch: str, total_bytes: int) -> Iterator[str]:
    """A POSIX-mode store in ``scratch`` with twice the slots the objects need.

    Twice, because a rewrite goes to a fresh slot before the old one is freed; sized for
    objects up to the default slot size (2 MiB plus a page header).
    """
    root = os.path.join(scratch, "store")
    os.makedirs(root, exist_ok=True)
    slot_bytes = Hf3fsConfig(root=root).slot_bytes
    slots = max(2 * -(-total_bytes // slot_bytes) + 64, _MIN_SLOTS)
    yield f"hf3fs://{root}?mode=posix&slots={slots}"


def raw_baseline(
    backend: Any, scratch: str, work: Any
) -> tuple[Callable[[Any, int, int], None], ...]:
    """(put, get): each object at ``index * stride`` of a file of its own, as the backend does."""
    config = getattr(backend, "config", None)
    if not isinstance(config, Hf3fsConfig):
        config = Hf3fsConfig(root=scratch)
    rows = int(work.source.shape[0])
    stride = config.stride
    fd = os.open(os.path.join(scratch, "raw-slots.data"), os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, rows * stride)
    pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="raw-3fs")
    threads = config.io_threads

    def run(move: Callable[[int, list[Any], int], int], arrays: Any, lo: int, hi: int) -> None:
        batch = list(range(lo, hi))
        step = -(-len(batch) // threads)
        chunks = [batch[i : i + step] for i in range(0, len(batch), step)]
        for _ in pool.map(lambda c: [move(fd, [arrays[j]], j * stride) for j in c], chunks):
            pass

    def put(w: Any, lo: int, hi: int) -> None:
        run(os.pwritev, w.source, lo, hi)

    def get(w: Any, lo: int, hi: int) -> None:
        run(os.preadv, w.dest, lo, hi)

    # Released when the benchmark drops the callables (or at exit): no thread outlives its use.
    weakref.finalize(put, _release, pool, fd)
    return put, get


def _release(pool: ThreadPoolExecutor, fd: int) -> None:
    pool.shutdown(wait=True)
    os.close(fd)
