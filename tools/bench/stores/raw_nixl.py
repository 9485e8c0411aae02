"""The raw NIXL baseline of ``hicache bench backends --backend nixl``.

The baseline is a NIXL agent of its own doing the same POSIX file transfers the plainest way:
the workload's source and destination arrays registered as DRAM once, then per batch of 32
objects: open the 32 files, register them as FILE, one transfer, deregister, close. A put
writes ``<key>.tmp`` and renames it over ``<key>``, as the ``file`` baseline does: publishing
atomically is part of the job (on ext4 a rename over an existing file costs about as much as
writing its 2 MiB, so a baseline that rewrote files in place would measure another job). It
uses the backend's POSIX queue and fsync setting, so both sides take the same kernel path.

The backend gets what a host pool gives it: the same two arrays registered once through
:meth:`NixlBackend.register_memory`, so its transfers are zero-copy too. What the backend adds on
top is its own work: temporary files and renames (atomic publish), sizes by fstat, batching and
polling on a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from hicache.backends.nixl.agent import load_nixl_api
from hicache.backends.nixl.backend import QUEUE_PARAMS, NixlBackend, NixlPlugin, PosixQueue

__all__ = ["provision", "raw_baseline"]


@contextlib.contextmanager
def provision(scratch: str, total_bytes: int) -> Iterator[str]:
    """A POSIX store in the benchmark's scratch directory; nothing to start or stop."""
    yield f"nixl://{scratch}/store?plugin=posix"


def raw_baseline(
    backend: Any, scratch: str, work: Any
) -> tuple[Callable[[Any, int, int], None], ...]:
    """(put, get) moving ``work`` through a raw NIXL agent; registers ``work`` with the backend."""
    queue, fsync = PosixQueue.POSIX_AIO, False
    if isinstance(backend, NixlBackend):
        if backend.config.plugin is not NixlPlugin.POSIX:
            raise ValueError("the raw NIXL baseline covers POSIX stores (nixl:///dir?plugin=posix)")
        queue, fsync = backend.config.posix_queue, backend.config.fsync
        backend.register_memory(work.source)
        backend.register_memory(work.dest)
    api = load_nixl_api()
    agent = api.nixl_agent(f"raw-bench-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(backends=[]))
    agent.create_backend("POSIX", dict(QUEUE_PARAMS[queue]))
    agent.register_memory(
        [(arr.ctypes.data, arr.nbytes, 0, "") for arr in (work.source, work.dest)], "DRAM"
    )
    root = os.path.join(scratch, "raw")
    os.makedirs(root, exist_ok=True)
    row_bytes = int(work.source.shape[1])

    def run(op: str, array: Any, lo: int, hi: int, flags: int, suffix: str) -> None:
        """One batch: open and register its files, one transfer, deregister, close."""
        keys = work.keys[lo:hi]
        fds = [os.open(os.path.join(root, key + suffix), flags, 0o644) for key in keys]
        files = agent.register_memory([(0, row_bytes, fd, "") for fd in fds], "FILE")
        local = [(array[lo + i].ctypes.data, row_bytes, 0) for i in range(len(keys))]
        handle = agent.initialize_xfer(
            op,
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs([(0, row_bytes, fd) for fd in fds], "FILE"),
            agent.name,
        )
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        agent.deregister_memory(files)
        for fd in fds:
            if fsync:
                os.fsync(fd)
            os.close(fd)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {op} ended in state {state}")
        if suffix:
            for key in keys:
                path = os.path.join(root, key)
                os.replace(path + suffix, path)

    def put(w: Any, lo: int, hi: int) -> None:
        run("WRITE", w.source, lo, hi, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, ".tmp")

    def get(w: Any, lo: int, hi: int) -> None:
        run("READ", w.dest, lo, hi, os.O_RDONLY, "")

    return put, get
