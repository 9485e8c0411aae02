"""The raw Mooncake baseline of ``hicache bench backends --backend mooncake``.

The baseline is a ``MooncakeDistributedStore`` client of its own on the same master, with the
workload's source and destination registered, moving batches of 32 objects with
``batch_upsert_from`` / ``batch_get_into``, one call per batch: what a caller of the library
does at best. Upsert,
not ``batch_put_from``: a put of a key that exists returns 0 without writing (measured), so
repeated rounds would time nothing. Its keys carry a ``raw-<id>-`` prefix, apart from the backend's,
and its puts prefer its own segment exactly when the backend's do (``prefer_local_segment``).

The backend gets the same memory through ``register_memory``, as a host pool gives it its
buffer, so both sides take the zero-copy path; ``provision`` starts a master for the run.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hicache.backends.mooncake.backend import MooncakeBackend, setup_params
from hicache.backends.mooncake.client import load_store_class
from hicache.errors import BackendError
from hicache.tools.services.mooncake import MooncakeMaster

__all__ = ["provision", "raw_baseline"]

_RAW_CLIENTS: list[Any] = []  # closed before the provisioned master stops, or at exit


def raw_baseline(
    backend: Any, scratch: str, work: Any
) -> tuple[Callable[[Any, int, int], None], Callable[[Any, int, int], None]]:
    """(put, get) moving one batch of ``work`` through a raw client on the backend's master."""
    if not isinstance(backend, MooncakeBackend):
        raise TypeError(f"the mooncake baseline needs a MooncakeBackend, not {type(backend)}")
    cfg = backend.config
    store = load_store_class()()
    rc = store.setup(*setup_params(cfg).setup_args())  # the backend's own arguments
    if rc != 0:
        raise BackendError(f"raw Mooncake client setup against {cfg.master} failed ({rc})")
    _RAW_CLIENTS.append(store)
    for array in (work.source, work.dest):
        _check(store.register_buffer(int(array.ctypes.data), array.nbytes), "register_buffer")
        backend.register_memory(array)
    placement = importlib.import_module("mooncake.store").ReplicateConfig()
    if cfg.prefer_local_segment:  # the same placement as the backend's
        placement.preferred_segment = store.get_hostname()
    tag = uuid.uuid4().hex[:8]  # a key space per baseline: the bench runs two side by side
    keys = [f"raw-{tag}-{k}" for k in work.keys]
    size = int(work.source.shape[1])

    def move(fn: Any, rows: np.ndarray, lo: int, hi: int, what: str, *extra: Any) -> None:
        base = int(rows.ctypes.data)
        ptrs = [base + i * size for i in range(lo, hi)]
        out = fn(keys[lo:hi], ptrs, [size] * (hi - lo), *extra)
        if any(r < 0 for r in out):
            raise BackendError(f"raw Mooncake {what} failed: {out}")

    def put(w: Any, lo: int, hi: int) -> None:
        move(store.batch_upsert_from, w.source, lo, hi, "put", placement)

    def get(w: Any, lo: int, hi: int) -> None:
        move(store.batch_get_into, w.dest, lo, hi, "get")

    return put, get


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise BackendError(f"raw Mooncake {what} failed ({rc})")


@atexit.register
def _close_raw_clients() -> None:
    while _RAW_CLIENTS:
        _RAW_CLIENTS.pop().close()


@contextlib.contextmanager
def provision(scratch: str, total_bytes: int) -> Iterator[str]:
    """A master for the run; the URL gives each client room for the whole workload."""
    segment = max(total_bytes + total_bytes // 4 + (64 << 20), 256 << 20)
    master = MooncakeMaster(log_path=os.path.join(scratch, "mooncake_master.log"))
    with master:
        try:
            yield master.url(global_segment_bytes=segment, staging_bytes="64M")
        finally:
            _close_raw_clients()  # while the master lives: a teardown without it hangs
