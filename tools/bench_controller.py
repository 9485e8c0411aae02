"""``hicache bench controller``: what the controller costs, and how close to raw L3 I/O it runs.

Two measurements, each against a baseline from the same run:

* ``overhead_us_per_page``: process CPU time per page moved from one tier to another, with a
  zero-latency memory backend and small pages, so the figure is the controller's bookkeeping
  (tree, hashes, keys, codec headers, queues, tasks), not the copies: insert with write_through
  (device -> host -> L3), evict to host, drop the host copy, prefetch from L3 and load back;
  each page is moved four times. The memory backend's own time is measured and left out
  (``with_backend_us_per_page`` keeps it); ``round_trip_us_per_page`` is the whole
  device -> L3 -> device trip of one page.
  ``memcpy_us_per_page`` is what copying the same bytes costs, for scale.
* ``l3_roundtrip_ratio``: 2 MiB pages from host memory to a file L3 and back through the
  controller's storage tier (codec, keys, existence checks, batches, acknowledgements), against
  the raw file backend putting and getting the same page bytes under plain keys.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import tempfile
import time
from typing import Any

import torch

from hicache.backends.base import StorageBackend
from hicache.backends.registry import open_backend
from hicache.dtypes import DType
from hicache.keys import RadixKey
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.pool_spec import ModelShape, PoolPreset, preset
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.bundler import BundlePage
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.config import HiCacheConfig, PrefetchConfig, StorageConfig
from hicache.tiering.controller import HiCacheController
from hicache.tiering.storage_tier import PrefetchOp, WriteJob

__all__ = ["add_bench_controller_parser", "run_bench_controller"]

_BATCH = 32  # pages per backend call, for the controller and the raw baseline alike


async def _build(shape: ModelShape, device_tokens: int, host_pages: int, url: str) -> Any:
    model = preset(PoolPreset.DENSE, shape)
    config = HiCacheConfig(
        prefetch=PrefetchConfig(threshold_tokens=shape.page_size, batch_pages=_BATCH),
        storage=StorageConfig(url=url, write_batch_pages=_BATCH, write_queue_pages=1 << 20),
    )
    device = device_pools(model, {"kv": device_tokens}, "cpu")
    host = host_pools(model, {"kv": host_pages}, pin_memory=False)
    return await HiCacheController.open(config, device, host)


class _CpuTimed:
    """Forwards to a backend and adds up the process CPU time spent inside it.

    The memory backend does its work without awaiting, so the time between entering and
    leaving a call is the backend's own (copies, key checks); the rest is the controller's.
    """

    def __init__(self, inner: StorageBackend) -> None:
        self._inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in ("exists", "get_into", "put", "leading_hits"):
            return attr

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return await attr(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start

        return timed


async def _overhead_round(pages: int, seqs: int) -> tuple[float, float, int]:
    """CPU seconds of one write-then-prefetch round (all, and inside the backend), and the
    pages it moved."""
    shape = ModelShape(layers=2, heads=1, head_dim=8, page_size=4, dtype=DType.BFLOAT16)
    per_seq = pages * shape.page_size
    ctl = await _build(shape, per_seq * seqs, pages * seqs * 2, "memory://")
    timed = _CpuTimed(ctl.storage.backend)
    ctl.storage.backend = timed
    try:
        tokens = [[s * 1_000_000 + i for i in range(per_seq)] for s in range(seqs)]
        start = time.process_time()
        tree = HiRadixCache(ctl, RadixCacheConfig(page_size=shape.page_size))
        for seq in tokens:
            tree.insert(RadixKey(seq), ctl.anchor_device.alloc(per_seq))
        await tree.quiesce()
        if ctl.metrics.counts["pages_written_l3"] < pages * seqs:
            raise RuntimeError("overhead round wrote fewer pages to L3 than it inserted")
        tree.evict(per_seq * seqs)
        tree.host_evictor.evict(per_seq * seqs)
        for i, seq in enumerate(tokens):
            key = RadixKey(seq)
            tree.prefetcher.start(f"r{i}", key, tree.match_prefix(key))
        await tree.quiesce()
        for seq in tokens:
            match = tree.match_prefix(RadixKey(seq))
            assert match.last_host_node is not None
            tree.init_load_back(match.last_host_node)
        cpu = time.process_time() - start
        counts, page_bytes = ctl.metrics.counts, ctl.page_bytes
        back = int(counts["l3_hit_tokens"]) // shape.page_size
        if back != pages * seqs:
            raise RuntimeError(f"overhead round moved {back} of {pages * seqs} pages back")
        # Every tier-to-tier copy of a page: device->host, host->L3, L3->host, host->device.
        moved = (
            int(counts["bytes_device_to_host"]) // page_bytes
            + int(counts["pages_written_l3"])
            + back
            + int(counts["bytes_host_to_device"]) // page_bytes
        )
        return cpu, timed.seconds, moved
    finally:
        ctl.storage.backend = timed._inner
        await ctl.close()


def _memcpy_us_per_page(page_bytes: int, n: int = 20_000) -> float:
    src = torch.ones(n, page_bytes, dtype=torch.uint8)
    dst = torch.zeros(n, page_bytes, dtype=torch.uint8)
    start = time.perf_counter()
    dst.copy_(src)
    return (time.perf_counter() - start) / n * 1e6


async def _roundtrip_controller(ctl: HiCacheController, pages: int) -> float:
    storage, names = ctl.storage, list(ctl.host_pools)
    seed = bytes(32)
    hashes = [i.to_bytes(4, "little") * 8 for i in range(1, pages + 1)]
    bundle = [
        BundlePage(seed, h, dict.fromkeys(names, i), i, hashes[i - 1] if i else bytes(32))
        for i, h in enumerate(hashes)
    ]
    start = time.perf_counter()
    job = WriteJob(bundle, 1.0)
    storage.submit_write(job)
    while job.ok is None:
        await storage.wait_for_activity(1.0)
    if not all(job.ok):
        raise RuntimeError("a controller L3 write failed during the benchmark")
    back = list(range(pages, 2 * pages))
    candidates = [dataclasses.replace(p, host_pages=dict.fromkeys(names, -1)) for p in bundle]
    op = PrefetchOp("bench", candidates, lambda n: back[:n], time.monotonic())
    storage.start_prefetch(op)
    while not op.reads_finished:
        await storage.wait_for_activity(1.0)
    seconds = time.perf_counter() - start
    if op.completed_pages != pages:
        raise RuntimeError(f"controller read back {op.completed_pages} of {pages} pages")
    storage.write_acks.clear()
    storage.finished_prefetches.clear()
    return seconds


async def _roundtrip_raw(url: str, ctl: HiCacheController, pages: int, tag: str) -> float:
    host = ctl.anchor_host
    backend = await open_backend(url)
    try:
        keys = [f"raw-{tag}-{i:06d}" for i in range(pages)]
        start = time.perf_counter()
        for lo in range(0, pages, _BATCH):
            batch = range(lo, min(lo + _BATCH, pages))
            values = [host.page_segments(i) for i in batch]
            if not all(await backend.put([keys[i] for i in batch], values)):
                raise RuntimeError("a raw put failed during the benchmark")
        for lo in range(0, pages, _BATCH):
            batch = range(lo, min(lo + _BATCH, pages))
            got = await backend.get_into(
                [keys[i] for i in batch], [host.page_segments(pages + i) for i in batch]
            )
            if min(got) < 0:
                raise RuntimeError("a raw get missed during the benchmark")
        return time.perf_counter() - start
    finally:
        await backend.close()


async def _l3_roundtrip(pages: int, repeats: int, scratch: str) -> dict[str, float]:
    shape = ModelShape(layers=16, heads=8, head_dim=64, page_size=64)  # 2 MiB bf16 pages
    best = {"controller": float("inf"), "raw": float("inf")}
    page_bytes = 0
    for r in range(repeats):
        url = f"file://{scratch}/l3-{r}"
        ctl = await _build(shape, shape.page_size, 2 * pages, url)
        try:
            host = ctl.anchor_host
            host.alloc(2 * pages)
            host.buffer.view(-1)[: pages * host.buffer[0].numel()].normal_()
            page_bytes = host.spec.page_bytes
            raw = await _roundtrip_raw(f"file://{scratch}/raw-{r}", ctl, pages, str(r))
            best["raw"] = min(best["raw"], raw)
            best["controller"] = min(best["controller"], await _roundtrip_controller(ctl, pages))
            if not torch.equal(host.buffer[:pages], host.buffer[pages : 2 * pages]):
                raise RuntimeError("pages read back through the controller differ")
        finally:
            await ctl.close()
    moved = 2 * pages * page_bytes / 1e9
    return {
        "page_bytes": page_bytes,
        "pages": pages,
        "l3_roundtrip_gbps": round(moved / best["controller"], 3),
        "raw_roundtrip_gbps": round(moved / best["raw"], 3),
        "l3_roundtrip_ratio": round(best["raw"] / best["controller"], 3),
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    rounds = [
        await _overhead_round(args.overhead_pages, args.sequences) for _ in range(args.repeats)
    ]
    cpu, in_backend, moved = min(rounds)
    pages_round_trip = moved // 4
    scratch = tempfile.mkdtemp(prefix="hicache-bench-ctl-", dir=args.dir)
    try:
        l3 = await _l3_roundtrip(args.pages, args.repeats, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "overhead_us_per_page": round((cpu - in_backend) / moved * 1e6, 2),
        "with_backend_us_per_page": round(cpu / moved * 1e6, 2),
        "overhead_pages_moved": moved,
        "round_trip_us_per_page": round((cpu - in_backend) / pages_round_trip * 1e6, 2),
        "memcpy_us_per_page": round(_memcpy_us_per_page(2 * 2 * 8 * 4 * 2), 3),
        **l3,
    }


def add_bench_controller_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "controller", help="controller CPU overhead per page, and L3 round trip vs raw file I/O"
    )
    p.add_argument("--overhead-pages", type=int, default=64, help="pages per sequence")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--pages", type=int, default=128, help="2 MiB pages in the L3 round trip")
    p.add_argument("--repeats", type=int, default=3, help="best of N")
    p.add_argument("--dir", help="scratch directory for the file L3 (default: temp)")
    p.add_argument("--json", action="store_true")
    return p


def run_bench_controller(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [asyncio.run(_run(args))]
