"""``hicache bench backends``: put/get throughput of each backend against a raw baseline.

The baseline moves the same bytes in the same run, the plainest way there is: for ``file``,
open/write/rename per object with the same fsync setting and open/readinto a preallocated
buffer; for ``memory`` and ``shm``, a memcpy into and out of a preallocated, touched buffer;
for ``disk``, ``pwritev``/``preadv`` on one preallocated file (``raw_disk``); for the others,
the raw client library (``raw_*``). Backend and baseline runs alternate, round after round,
because this machine is shared and noisy: each GB/s figure (1e9 bytes per second) is the
median of the rounds with its range (``_min``, ``_max``), and each ratio the median of the
rounds' own ratios (both sides of a round ran one right after the other), with its range.

Both sides move batches of 32 objects, and the baseline runs two ways:

- ``raw``: each batch through ``asyncio.to_thread`` from the benchmark's event loop, as any
  asyncio caller must call a blocking library. The backends are async by contract and pay the
  same round trip; ``put_ratio`` and ``get_ratio`` compare against this.
- ``raw_blocking``: every batch back to back in one thread, with no event loop at all.
  ``*_ratio_blocking`` compare against this; the difference between the two baselines is
  the loop-to-thread round trip itself (0.3-0.5 ms a call on a 2-core VM).

Every step also reports its CPU cost, ``LABEL_cpu_us``: the process CPU time
(``time.process_time``, every thread of the process) it took, per object, the median of the
rounds with its range; ``put_cpu_ratio`` and ``get_cpu_ratio`` are the backend's CPU over the
async raw baseline's (above 1: the backend spends more).

A client library with an asyncio API of its own (``redis``: its module has ``async_baseline``)
gets that instead of both: the bare client on the bench's event loop, as the backend runs, with
no thread in between; ``put_ratio`` and ``get_ratio`` compare against it, and ``exists`` is
timed too (``exists_kops``: thousands of keys a second; ``exists_ratio``).

With ``open_objects``, only the open benchmark runs instead (``store_open``): the time to
open a ``disk`` (and ``file``) store of that many small objects left by a writer that died.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.backends.base import StorageBackend
from hicache.backends.disk.config import DEFAULT_SEGMENT_BYTES
from hicache.backends.disk.format import record_bytes
from hicache.backends.registry import open_backend
from hicache.errors import InvalidArgumentError
from hicache.keys import KEY_MAX_LEN
from hicache.tools.bench.bench_flags import (
    JSON_LINES,
    add_bench_parser,
    repeats_flag,
    scratch_dir_flag,
)
from hicache.tools.bench.limits import MAX_OBJECT_BYTES, MAX_OBJECTS
from hicache.tools.bench.rounds import rotated
from hicache.tools.bench.stores.backend_row import backend_row, cpu_figures
from hicache.tools.bench.stores.raw_local import file_baseline, memcpy_baseline
from hicache.tools.cli_parsing import Flag, check_memory, int_range, size_range, url_arg

__all__ = [
    "BackendBenchConfig",
    "add_bench_backends_parser",
    "run_backend_bench",
    "run_bench_backends",
]

_BATCH = 32  # keys per put/get call: what a controller sends for a 32-page prefix
_WAYS = ("async", "blocking")  # the two ways the raw baseline is driven


@dataclass(frozen=True, slots=True)
class BackendBenchConfig:
    backends: tuple[str, ...] = ("memory", "file", "shm")
    url: str | None = None
    objects: int = 256
    object_bytes: int = 2 << 20
    repeats: int = 6
    directory: str | None = None
    # Above 0: only the open benchmark runs, over stores of this many small objects (see
    # hicache.tools.bench.stores.store_open).
    open_objects: int = 0


@dataclass(slots=True)
class _Workload:
    keys: list[str]
    source: np.ndarray  # objects x object_bytes, random
    dest: np.ndarray  # same shape, touched

    @property
    def nbytes(self) -> int:
        return int(self.source.nbytes)


# Backends whose raw client baseline, and any service they need (a master, an S3 server), live
# in a module of their own: ``raw_baseline(backend, scratch, work) -> (put, get)``, each moving
# the objects ``lo`` to ``hi - 1`` of the work (``put(work, lo, hi)``), and, optionally,
# ``provision(scratch, total_bytes)``, a context manager that yields the URL to open when no
# ``--url`` is given. The names are module names under hicache.tools.bench.stores;
# ``file``, ``memory`` and ``shm`` have theirs in raw_local.
_RAW_MODULES: dict[str, str] = {
    "fsspec": "raw_fsspec",
    "mooncake": "raw_mooncake",
    "nixl": "raw_nixl",
    "3fs": "raw_hf3fs",
    "disk": "raw_disk",
    "redis": "raw_redis",
}


def _raw_module(name: str) -> Any | None:
    module = _RAW_MODULES.get(name)
    return importlib.import_module(f"hicache.tools.bench.stores.{module}") if module else None


def _default_url(name: str, scratch: str, total: int, object_bytes: int) -> str:
    capacity = total + total // 4 + (64 << 20)
    if name == "file":
        return f"file://{scratch}/store"
    if name == "disk":
        return _disk_url(scratch, total // object_bytes, object_bytes)
    if name == "shm":
        return f"shm://hicache-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}?capacity_bytes={capacity}"
    if name == "memory":
        return f"memory://?capacity_bytes={capacity}"
    return f"{name}://"


def _disk_url(scratch: str, objects: int, object_bytes: int) -> str:
    """A disk store with segments that hold any object (at least the default 256 MiB), and a
    capacity of three copies of the objects' records: the segments of old rounds, dead once
    the next round rewrote their keys, are reclaimed instead of filling the disk."""
    # A spare MiB covers the segment's header and the record's header, key and padding.
    mib = -(-(object_bytes + (1 << 20)) // (1 << 20))
    segment = max(DEFAULT_SEGMENT_BYTES, mib << 20)
    capacity = 3 * objects * record_bytes(KEY_MAX_LEN, object_bytes) + 2 * segment
    return f"disk://{scratch}/store?segment_bytes={segment}&capacity={capacity}"


async def _timed(fn: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """Wall seconds and process CPU seconds (every thread's) of ``fn``."""
    start, cpu = time.perf_counter(), time.process_time()
    await fn()
    return time.perf_counter() - start, time.process_time() - cpu


def _batches(n: int) -> list[tuple[int, int]]:
    """(lo, hi) of each batch of ``_BATCH`` objects out of ``n``."""
    return [(lo, min(lo + _BATCH, n)) for lo in range(0, n, _BATCH)]


async def _backend_put(backend: StorageBackend, work: _Workload) -> None:
    for lo, hi in _batches(len(work.keys)):
        ok = await backend.put(work.keys[lo:hi], [work.source[j] for j in range(lo, hi)])
        if not all(ok):
            raise RuntimeError(f"{backend.name}: a put failed during the benchmark")


async def _backend_exists(backend: StorageBackend, work: _Workload) -> None:
    for lo, hi in _batches(len(work.keys)):
        if not all(await backend.exists(work.keys[lo:hi])):
            raise RuntimeError(f"{backend.name}: an object was lost during the benchmark")


async def _backend_get(backend: StorageBackend, work: _Workload) -> None:
    for lo, hi in _batches(len(work.keys)):
        got = await backend.get_into(work.keys[lo:hi], [work.dest[j] for j in range(lo, hi)])
        if any(n != work.source.shape[1] for n in got):
            raise RuntimeError(f"{backend.name}: a get missed during the benchmark")


BatchMove = Callable[[_Workload, int, int], None]  # moves objects lo .. hi - 1


def _raw_baseline(
    name: str, backend: StorageBackend, scratch: str, work: _Workload
) -> tuple[BatchMove, BatchMove]:
    """(put, get) batch movers for the raw baseline matching this backend."""
    module = _raw_module(name)
    if module is not None:
        return module.raw_baseline(backend, scratch, work)  # type: ignore[no-any-return]
    if name == "file":
        return file_baseline(backend, scratch)
    return memcpy_baseline(work)  # memory, shm and anything else


async def _raw_async(move: BatchMove, work: _Workload) -> None:
    """Each batch through ``asyncio.to_thread``: how an asyncio caller uses a blocking client."""
    for lo, hi in _batches(len(work.keys)):
        await asyncio.to_thread(move, work, lo, hi)


def _raw_blocking(move: BatchMove, work: _Workload) -> None:
    """Every batch back to back on the calling thread."""
    for lo, hi in _batches(len(work.keys)):
        move(work, lo, hi)


async def _bench_backend(
    name: str, url: str, work: _Workload, cfg: BackendBenchConfig
) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="hicache-bench-", dir=cfg.directory)
    try:
        with contextlib.ExitStack() as services:
            url = url or _provisioned_url(name, scratch, work, services)
            return await _bench_open(name, url, scratch, work, cfg)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _provisioned_url(
    name: str, scratch: str, work: _Workload, services: contextlib.ExitStack
) -> str:
    module = _raw_module(name)
    provision = getattr(module, "provision", None)
    if provision is None:
        return _default_url(name, scratch, work.nbytes, int(work.source.shape[1]))
    return str(services.enter_context(provision(scratch, work.nbytes)))


async def _bench_open(
    name: str, url: str, scratch: str, work: _Workload, cfg: BackendBenchConfig
) -> dict[str, Any]:
    backend = await open_backend(url)
    try:
        module = _raw_module(name)
        if hasattr(module, "async_baseline"):
            times, cpu = await _async_rounds(backend, module, work, cfg.repeats)
        else:
            times, cpu = await _thread_rounds(name, backend, scratch, work, cfg.repeats)
    finally:
        unlink = getattr(backend, "unlink", None)
        await backend.close()
        if callable(unlink):
            unlink()
    objects, object_bytes = len(work.keys), int(work.source.shape[1])
    return backend_row(name, objects, object_bytes, times) | cpu_figures(objects, cpu)


Rounds = tuple[dict[str, list[float]], dict[str, list[float]]]  # wall and CPU seconds per step


async def _thread_rounds(
    name: str, backend: StorageBackend, scratch: str, work: _Workload, repeats: int
) -> Rounds:
    """The backend against a blocking baseline, driven both ways (see the module docstring)."""
    # Each baseline has files (keys, a client) of its own, as the backend has: shared, their
    # pages would be touched twice as often as the backend's and stay the warmer ones.
    raw = {way: _raw_baseline(name, backend, _subdir(scratch, way), work) for way in _WAYS}
    await _backend_put(backend, work)  # warm: directories, arena pages, caches
    await _backend_get(backend, work)
    if not np.array_equal(work.dest, work.source):
        raise RuntimeError(f"{name}: data read back differs from data written")
    for raw_put, raw_get in raw.values():
        _raw_blocking(raw_put, work)
        work.dest.fill(1)
        _raw_blocking(raw_get, work)
        if not np.array_equal(work.dest, work.source):
            raise RuntimeError(f"{name}: the raw baseline read back other data")
    (async_put, async_get), (blocking_put, blocking_get) = raw["async"], raw["blocking"]
    steps: dict[str, Callable[[], Awaitable[Any]]] = {
        "put": lambda: _backend_put(backend, work),
        "raw_put": lambda: _raw_async(async_put, work),
        "raw_put_blocking": lambda: asyncio.to_thread(_raw_blocking, blocking_put, work),
        "get": lambda: _backend_get(backend, work),
        "raw_get": lambda: _raw_async(async_get, work),
        "raw_get_blocking": lambda: asyncio.to_thread(_raw_blocking, blocking_get, work),
    }
    groups = [["put", "raw_put", "raw_put_blocking"], ["get", "raw_get", "raw_get_blocking"]]
    return await _timed_rounds(steps, groups, repeats)


async def _async_rounds(
    backend: StorageBackend, module: Any, work: _Workload, repeats: int
) -> Rounds:
    """The backend against its client library's own asyncio API, on this loop."""
    name = backend.name

    async def each_batch(move: Callable[[_Workload, int, int], Awaitable[None]]) -> None:
        for lo, hi in _batches(len(work.keys)):
            await move(work, lo, hi)

    async with module.async_baseline(backend, work) as raw:
        await _backend_put(backend, work)
        await _backend_get(backend, work)
        await each_batch(raw.put)
        if not np.array_equal(work.dest, work.source):
            raise RuntimeError(f"{name}: data read back differs from data written")
        work.dest.fill(1)
        await each_batch(raw.get)
        if not np.array_equal(work.dest, work.source):
            raise RuntimeError(f"{name}: the raw baseline read back other data")
        steps: dict[str, Callable[[], Awaitable[Any]]] = {
            "put": lambda: _backend_put(backend, work),
            "raw_put": lambda: each_batch(raw.put),
            "get": lambda: _backend_get(backend, work),
            "raw_get": lambda: each_batch(raw.get),
            "exists": lambda: _backend_exists(backend, work),
            "raw_exists": lambda: each_batch(raw.exists),
        }
        groups = [["put", "raw_put"], ["get", "raw_get"], ["exists", "raw_exists"]]
        return await _timed_rounds(steps, groups, repeats)


def _subdir(scratch: str, way: str) -> str:
    path = os.path.join(scratch, f"raw-{way}")
    os.makedirs(path, exist_ok=True)
    return path


async def _timed_rounds(
    steps: dict[str, Callable[[], Awaitable[Any]]], groups: list[list[str]], repeats: int
) -> Rounds:
    """The wall seconds and the process CPU seconds of each step in each of ``repeats``
    rounds; a round runs each group's steps one after the other."""
    times: dict[str, list[float]] = {label: [] for label in steps}
    cpu: dict[str, list[float]] = {label: [] for label in steps}
    for repeat in range(repeats):
        # Alternate, so noise hits every side alike, and rotate who goes first, so over as many
        # rounds as a group has steps each side takes each place once.
        for group in groups:
            for label in rotated(group, repeat):
                # Untimed: every step starts with no dirty pages. Without this a disk-bound put
                # paid for the previous step's writeback and one baseline read 0.8 GB/s in a
                # run where the same code, one place over, read 1.9.
                await asyncio.to_thread(os.sync)
                wall, used = await _timed(steps[label])
                times[label].append(wall)
                cpu[label].append(used)
    return times, cpu


async def run_backend_bench(cfg: BackendBenchConfig) -> list[dict[str, Any]]:
    """One row per backend: put/get figures, or with ``open_objects`` its open figures."""
    if cfg.open_objects < 0:
        raise InvalidArgumentError("open objects must not be negative")
    if cfg.open_objects:
        from hicache.tools.bench.stores.store_open import run_open_bench

        return await run_open_bench(cfg.backends, cfg.open_objects, cfg.directory)
    if cfg.objects <= 0 or cfg.object_bytes <= 0 or cfg.repeats <= 0:
        raise InvalidArgumentError("objects, object bytes and repeats must be positive")
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, size=(cfg.objects, cfg.object_bytes), dtype=np.uint8)
    work = _Workload(
        keys=[f"bench-{i:06d}" for i in range(cfg.objects)],
        source=source,
        dest=np.ones_like(source),
    )
    results = []
    for name in cfg.backends:
        url = cfg.url if cfg.url and len(cfg.backends) == 1 else None
        results.append(await _bench_backend(name, url or "", work, cfg))
    return results


def _backend_name(text: str) -> str:
    """A registered backend's name (its client need not be installed: the run says so)."""
    from hicache.backends.registry import default_registry

    names = sorted(entry.name for entry in default_registry.entries())
    if text not in names:
        raise argparse.ArgumentTypeError(f"no backend {text!r}; registered: {', '.join(names)}")
    return text


_FLAGS = (
    Flag("--backend", _backend_name, help="backend name (repeatable)", action="append"),
    Flag("--url", url_arg, help="backend URL (with a single --backend)"),
    Flag("--objects", int_range(1, MAX_OBJECTS), 256),
    Flag("--object-bytes", size_range(1, MAX_OBJECT_BYTES), 2 << 20),
    repeats_flag(
        6, "rounds (a multiple of 3 puts each side in each place equally): each figure is "
        "their median, with its range",
    ),
    scratch_dir_flag("scratch directory for file stores (default: temp)"),
    Flag(
        "--open-objects", int_range(1, MAX_OBJECTS),
        help="instead of put/get: time opening a disk (and file, up to 200000) store of this "
        "many 64-byte objects whose writer died (default backends: disk, file)",
    ),
    JSON_LINES,
)  # fmt: skip


def add_bench_backends_parser(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``backends`` to the ``hicache bench`` subcommands; :func:`run_bench_backends` runs
    it."""
    help_text = "backend put/get vs raw I/O or memcpy"
    return add_bench_parser(bench_sub, "backends", help_text, _FLAGS, run_bench_backends)


def run_bench_backends(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``hicache bench backends``: :func:`run_backend_bench` with the parsed flags."""
    if args.open_objects:
        default: tuple[str, ...] = ("disk", "file")
    else:
        check_memory(args.objects * args.object_bytes * 2, "--objects x --object-bytes x 2")
        default = ("memory", "file", "shm")
    config = BackendBenchConfig(
        backends=tuple(args.backend or default),
        url=args.url,
        objects=args.objects,
        object_bytes=args.object_bytes,
        repeats=args.repeats,
        directory=args.dir,
        open_objects=args.open_objects or 0,
    )
    return asyncio.run(run_backend_bench(config))
