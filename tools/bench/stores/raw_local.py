"""The raw baselines of ``hicache bench backends`` for the stores with no client library: for
``file``, open/write/rename per object with the backend's fsync setting and open/readinto a
preallocated buffer; for ``memory``, ``shm`` and any other backend without a ``raw_*`` module of
its own, a memcpy into and out of a preallocated, touched buffer."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["file_baseline", "memcpy_baseline"]

BatchMove = Callable[[Any, int, int], None]  # moves objects lo .. hi - 1


def _file_put(work: Any, lo: int, hi: int, root: str, fsync: bool) -> None:
    for i in range(lo, hi):
        path = os.path.join(root, work.keys[i])
        tmp = path + ".tmp"
        with open(tmp, "wb", buffering=0) as f:
            f.write(work.source[i])
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)


def _file_get(work: Any, lo: int, hi: int, root: str) -> None:
    for i in range(lo, hi):
        with open(os.path.join(root, work.keys[i]), "rb", buffering=0) as f:
            f.readinto(work.dest[i])


def file_baseline(backend: Any, scratch: str) -> tuple[BatchMove, BatchMove]:
    """(put, get) of one file per object under ``scratch/raw``, fsynced when the backend's
    writes are."""
    root = os.path.join(scratch, "raw")
    os.makedirs(root, exist_ok=True)
    fsync = bool(getattr(getattr(backend, "config", None), "fsync", False))
    return (
        lambda w, lo, hi: _file_put(w, lo, hi, root, fsync),
        lambda w, lo, hi: _file_get(w, lo, hi, root),
    )


def memcpy_baseline(work: Any) -> tuple[BatchMove, BatchMove]:
    """(put, get) as the memcpy limit, one object per copy as the backend moves them (one
    512 MiB memcpy would run in a streaming-store mode no per-page copy gets)."""
    staging = np.ones_like(work.source)  # allocated and touched before timing

    def put(w: Any, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            np.copyto(staging[i], w.source[i])

    def get(w: Any, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            np.copyto(w.dest[i], staging[i])

    return put, get
