"""``hicache bench tools``: ``inspect`` and ``verify`` throughput against a raw walk of the files.

A file store is filled through the real write path (chains of pages with parent hashes, see
:func:`write_chain`), once with many small pages and once with fewer large ones. Then, in the
same run and alternating, best of N:

- ``inspect``: every header, through the backend's ``scan`` and ``peek``;
- ``raw_head``: ``os.scandir`` down the fan-out tree, ``open`` and ``pread`` of 160 bytes each;
- ``verify``: every byte, header and payload checksum, through ``scan`` and ``get_into``;
- ``raw_read``: the same walk, ``open`` and ``preadv`` of every whole file into one buffer.

The raw loops run on one thread with no checks at all: the plainest way to touch the same
bytes. Files are in the page cache (just written); nothing here measures the disk. GB/s is
store bytes covered per second (1e9), also for the header-only runs; ratios are tool rate over
raw rate (``inspect_ratio`` against ``raw_head``, ``verify_ratio`` against ``raw_read``).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.backends.base import StorageBackend
from hicache.backends.file import FileBackend, FileConfig
from hicache.codec import HEADER_SIZE, NO_PARENT, PageMeta, encode_page
from hicache.dtypes import DType, Layout
from hicache.keys import PageKeyScheme, RadixKey, StorageFormat
from hicache.tools.bench.bench_flags import (
    JSON_LINES,
    add_bench_parser,
    repeats_flag,
    scratch_dir_flag,
)
from hicache.tools.bench.limits import MAX_OBJECT_BYTES, MAX_OBJECTS
from hicache.tools.cli_parsing import Flag, check_disk, fields_from, int_range, size_range
from hicache.tools.store.inspect import InspectOptions, inspect_store
from hicache.tools.store.verify import VerifyOptions, verify_store

__all__ = [
    "ToolsBenchConfig",
    "add_bench_tools_parser",
    "run_bench_tools",
    "run_tools_bench",
    "write_chain",
]

_PAGE_TOKENS = 16
_CHAIN_PAGES = 32


@dataclass(frozen=True, slots=True)
class ToolsBenchConfig:
    small_objects: int = 100_000
    small_bytes: int = 4096  # payload bytes of a small page (the header adds 160)
    large_objects: int = 1000
    large_bytes: int = 2 << 20
    repeats: int = 3
    directory: str | None = None
    parallel: int = 2


def page_scheme(model_id: str = "bench-model", pool: str = "kv") -> PageKeyScheme:
    fmt = StorageFormat(model_id, DType.UINT8, Layout.PAGE_FIRST, _PAGE_TOKENS, pool=pool)
    return PageKeyScheme(fmt)


async def write_chain(
    backend: StorageBackend,
    scheme: PageKeyScheme,
    key: RadixKey,
    payloads: list[bytes | np.ndarray],
    compress: bool = False,
) -> list[str]:
    """Store one page per whole page of ``key`` as a chain (parent hashes, page indexes) and
    return the storage keys in chain order. Raises ``RuntimeError`` when a put fails."""
    hashes = scheme.page_hashes(key)
    if len(payloads) != len(hashes):
        raise ValueError(f"{len(hashes)} pages but {len(payloads)} payloads")
    keys = scheme.keys_for_hashes(hashes, key.extra_key, key.is_bigram)
    fmt = scheme.fmt
    values = []
    for index, (page_key, payload) in enumerate(zip(keys, payloads)):
        parent = NO_PARENT if index == 0 else hashes[index - 1]
        nbytes = payload.nbytes if isinstance(payload, np.ndarray) else len(payload)
        meta = PageMeta(
            fmt.pool, fmt.dtype, (nbytes // fmt.dtype.itemsize,), fmt.layout, index, parent
        )
        values.append(encode_page(page_key, payload, meta, compress=compress))
    if not all(await backend.put(keys, values)):
        raise RuntimeError("a put of the chain failed")
    return keys


async def fill_store(backend: StorageBackend, objects: int, payload_bytes: int, seed: int) -> None:
    """``objects`` pages in chains of up to 32, random payloads."""
    rng = np.random.default_rng(seed)
    scheme = page_scheme()
    chain = 0
    while objects > 0:
        pages = min(_CHAIN_PAGES, objects)
        tokens = rng.integers(0, 1 << 31, size=pages * _PAGE_TOKENS).tolist()
        data = rng.integers(0, 256, size=(pages, payload_bytes), dtype=np.uint8)
        await write_chain(backend, scheme, RadixKey(tokens, f"bench-{chain}"), list(data))
        objects -= pages
        chain += 1


def _walk(root: str, visit: Callable[[str], int]) -> tuple[int, int]:
    """``visit(path)`` for every object file below root's two fan-out levels: files, bytes."""
    files = nbytes = 0
    for top in os.scandir(root):
        if not top.is_dir():
            continue
        for sub in os.scandir(top.path):
            for entry in os.scandir(sub.path):
                if entry.name[0] != ".":
                    nbytes += visit(entry.path)
                    files += 1
    return files, nbytes


def _raw_read(root: str, buffer: bytearray) -> tuple[int, int]:
    views = [memoryview(buffer)]

    def visit(path: str) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.preadv(fd, views, 0)
        finally:
            os.close(fd)

    return _walk(root, visit)


def _raw_head(root: str) -> tuple[int, int]:
    def visit(path: str) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            return len(os.pread(fd, HEADER_SIZE, 0))
        finally:
            os.close(fd)

    return _walk(root, visit)


async def _bench_workload(
    name: str, objects: int, payload_bytes: int, cfg: ToolsBenchConfig
) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="hicache-bench-tools-", dir=cfg.directory)
    root = os.path.join(scratch, "store")
    try:
        backend = await FileBackend.open(FileConfig(root=root))
        try:
            await fill_store(backend, objects, payload_bytes, seed=len(name))
            buffer = bytearray(payload_bytes + HEADER_SIZE)
            sink = io.StringIO()

            async def inspect() -> None:
                summary = await inspect_store(backend, InspectOptions(parallel=cfg.parallel), sink)
                if summary.total.objects != objects:
                    raise RuntimeError(f"inspect saw {summary.total.objects} of {objects}")

            async def verify() -> None:
                report = await verify_store(backend, VerifyOptions(parallel=cfg.parallel))
                if report.objects != objects or report.bad:
                    raise RuntimeError(f"verify: {report.objects} of {objects}, {report.bad[:3]}")

            runs: dict[str, Callable[[], Any]] = {
                "inspect": inspect,
                "raw_head": lambda: asyncio.to_thread(_raw_head, root),
                "verify": verify,
                "raw_read": lambda: asyncio.to_thread(_raw_read, root, buffer),
            }
            best = await _best_of(runs, cfg.repeats + 1)  # the first round warms caches
            stored = objects * (payload_bytes + HEADER_SIZE)
        finally:
            await backend.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _row(name, objects, payload_bytes + HEADER_SIZE, stored, best)


async def _best_of(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for round_no in range(rounds):
        for label, fn in runs.items():
            start = time.perf_counter()
            await fn()
            seconds = time.perf_counter() - start
            if round_no:
                best[label] = min(best.get(label, float("inf")), seconds)
    return best


def _row(
    name: str, objects: int, object_bytes: int, stored: int, best: dict[str, float]
) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": name, "objects": objects, "object_bytes": object_bytes}
    for label, seconds in best.items():
        row[f"{label}_objects_per_s"] = round(objects / seconds)
        row[f"{label}_gbps"] = round(stored / seconds / 1e9, 3)
    row["inspect_ratio"] = round(best["raw_head"] / best["inspect"], 3)
    row["verify_ratio"] = round(best["raw_read"] / best["verify"], 3)
    return row


async def run_tools_bench(cfg: ToolsBenchConfig) -> list[dict[str, Any]]:
    if min(cfg.small_objects, cfg.large_objects, cfg.small_bytes, cfg.large_bytes) <= 0:
        raise ValueError("object counts and sizes must be positive")
    if cfg.repeats <= 0:
        raise ValueError("repeats must be positive")
    return [
        await _bench_workload("small", cfg.small_objects, cfg.small_bytes, cfg),
        await _bench_workload("large", cfg.large_objects, cfg.large_bytes, cfg),
    ]


# Each ToolsBenchConfig field the command line sets, and its flag.
_CONFIG_FLAGS = {
    "small_objects": Flag("--small-objects", int_range(1, MAX_OBJECTS), 100_000),
    "small_bytes": Flag("--small-bytes", size_range(1, MAX_OBJECT_BYTES), 4096),
    "large_objects": Flag("--large-objects", int_range(1, MAX_OBJECTS), 1000),
    "large_bytes": Flag("--large-bytes", size_range(1, MAX_OBJECT_BYTES), 2 << 20),
    "repeats": repeats_flag(3),
    "directory": scratch_dir_flag("scratch directory (default: temp)"),
}


def add_bench_tools_parser(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``tools`` to the ``hicache bench`` subcommands; :func:`run_bench_tools` runs it."""
    help_text = "inspect/verify vs a raw walk and read"
    flags = [*_CONFIG_FLAGS.values(), JSON_LINES]
    return add_bench_parser(bench_sub, "tools", help_text, flags, run_bench_tools)


def run_bench_tools(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``hicache bench tools``: :func:`run_tools_bench` with the parsed flags, once the stores
    are known to fit in the scratch directory."""
    total = args.small_objects * args.small_bytes + args.large_objects * args.large_bytes
    scratch = args.dir or tempfile.gettempdir()
    check_disk(
        scratch, total, "the stores", "in the scratch directory", "lower the object counts or sizes"
    )
    config = ToolsBenchConfig(**fields_from(args, _CONFIG_FLAGS))
    return asyncio.run(run_tools_bench(config))
