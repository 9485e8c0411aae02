"""``hicache bench controller``: what the controller costs, and how close to raw L3 I/O it runs.

Two measurements, each against a baseline from the same run:

* ``overhead_us_per_page``: process CPU time per page moved from one tier to another, with a
  zero-latency memory backend and small pages, so the figure is the controller's bookkeeping
  (tree, hashes, keys, codec headers, queues, tasks), not the copies: insert with write_through
  (device -> host -> L3), evict to host, drop the host copy, prefetch from L3 and load back;
  each page is moved four times. The memory backend's own time is measured and left out
  (``with_backend_us_per_page`` keeps it); ``round_trip_us_per_page`` is the whole
  device -> L3 -> device trip of one page.
  ``memcpy_us_per_page`` is what copying the same bytes costs, for scale (the median of five
  copies of 20,000 pages, the first of which faults the destination in).
* ``l3_roundtrip_ratio``: 2 MiB pages from host memory to a file L3 and back through the
  controller's storage tier (codec, keys, existence checks, batches, acknowledgements), against
  the raw file backend putting and getting the same page bytes under plain keys.
  ``l3_roundtrip_cpu_us_per_page`` and ``raw_roundtrip_cpu_us_per_page`` are the process CPU
  time (every thread's) per page of each side's round trip, and
  ``l3_roundtrip_extra_cpu_us_per_page`` the median of the rounds' differences: what the
  controller adds, a figure the disk's noise moves far less than the wall time.

Method (that of ``bench backends``, because this machine is shared and its disk's writeback
moves figures by 2x): an untimed warm-up of each step, then ``--repeats`` rounds. A round is
an overhead round, then the two L3 sides, which take turns going first, round by round; the
overhead rounds are spread over the run, so a burst of load elsewhere inflates few of their
CPU times. Each step starts after an untimed ``sync`` (an overhead round also after a full
garbage collection), so it never pays for an earlier step's dirty pages. Each L3 side has a
store directory of its own, writes keys no earlier round wrote and deletes them after its
step, untimed. Every figure is the median of the rounds, with its range as ``NAME_min`` and
``NAME_max``; the ratio is that of the two sides' median times, and its range that of the
rounds' own ratios (both sides of a round ran one right after the other).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from hicache.backends.base import StorageBackend
from hicache.backends.registry import open_backend
from hicache.dtypes import DType
from hicache.errors import ConfigError
from hicache.keys import RadixKey
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig
from hicache.tiering.controller import HiCacheController
from hicache.tools.bench.bench_flags import add_bench_parser, repeats_flag, scratch_dir_flag
from hicache.tools.bench.cache.controller_l3 import (
    BATCH_PAGES,
    CpuLog,
    close_tier,
    cpu_report,
    l3_report,
    open_tier,
    roundtrip_controller,
    roundtrip_raw,
)
from hicache.tools.bench.rounds import rotated, spread
from hicache.tools.cli_parsing import Flag, check_memory, int_range

__all__ = ["add_bench_controller_parser", "run_bench_controller"]

_L3_PAGE_BYTES = 2 << 20  # the round trip's pages (see _measure)
# Bounds of the flags: each overhead page is a few tree and queue objects moved four times;
# each L3 page takes 2 MiB of host memory twice and as much disk twice.
_MAX_OVERHEAD = 1 << 12
_MAX_OVERHEAD_TOTAL = 1 << 20
_MAX_PAGES = 1 << 14
Step = Callable[[int], Awaitable[float]]  # round number -> seconds timed (prepares, cleans up)


def _config(shape: ModelShape, url: str | None) -> HiCacheConfig:
    return HiCacheConfig(
        prefetch=PrefetchConfig(threshold_tokens=shape.page_size, batch_pages=BATCH_PAGES),
        storage=StorageConfig(url=url, write_batch_pages=BATCH_PAGES, write_queue_pages=1 << 20),
    )


async def _build(shape: ModelShape, device_tokens: int, host_pages: int, url: str | None) -> Any:
    model = preset(PoolPreset.DENSE, shape)
    device = device_pools(model, {"kv": device_tokens}, "cpu")
    host = host_pools(model, {"kv": host_pages}, pin_memory=False)
    return await HiCacheController.open(_config(shape, url), device, host)


class _CpuTimed:
    """Forwards to a backend and adds up the process CPU time spent inside it.

    The memory backend does its work without awaiting, so the time between entering and
    leaving a call is the backend's own (copies, key checks); the rest is the controller's.
    """

    def __init__(self) -> None:
        self._inner: Any = None
        self.seconds = 0.0

    def around(self, inner: StorageBackend) -> Any:
        """This timer in ``inner``'s place (the cache's ``wrap_l3_backend``)."""
        self._inner = inner
        return self

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
    timed = _CpuTimed()
    try:
        tokens = [[s * 1_000_000 + i for i in range(per_seq)] for s in range(seqs)]
        start = time.process_time()
        tree = HiRadixCache(ctl, RadixCacheConfig(page_size=shape.page_size))
        tree.wrap_l3_backend(timed.around)
        for seq in tokens:
            tree.insert(RadixKey(seq), ctl.anchor_device.alloc(per_seq))
        await tree.quiesce()
        if ctl.metrics.counts["pages_written_l3"] < pages * seqs:
            raise RuntimeError("overhead round wrote fewer pages to L3 than it inserted")
        tree.evict(per_seq * seqs)
        tree.evict_host(per_seq * seqs)
        for i, seq in enumerate(tokens):
            key = RadixKey(seq)
            tree.prefetch_start(f"r{i}", key, tree.match_prefix(key))
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
        await ctl.close()


def _memcpy_us_per_page(page_bytes: int, n: int = 20_000) -> float:
    src = torch.ones(n, page_bytes, dtype=torch.uint8)
    dst = torch.zeros(n, page_bytes, dtype=torch.uint8)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n * 1e6


async def _timed_rounds(
    steps: dict[str, Step], rounds: int, first: str | None = None
) -> dict[str, list[float]]:
    """Each step's seconds in each round. An untimed ``sync`` comes before every step, so no
    step pays for another's writeback. Step ``first``, if named, opens every round; the order
    of the others rotates, so over as many rounds as they are, each takes each place once."""
    names = [name for name in steps if name != first]
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in ([first] if first else []) + rotated(names, r):
            await asyncio.to_thread(os.sync)
            times[name].append(await steps[name](r))
    return times


class _Overhead:
    """The overhead step: one write-then-prefetch round per call, its figures kept."""

    def __init__(self, pages: int, seqs: int) -> None:
        self.pages, self.seqs = pages, seqs
        self.figures: dict[str, list[float]] = {"overhead": [], "backend": [], "trip": []}
        self.moved = 0

    async def warm(self) -> None:
        await _overhead_round(self.pages, self.seqs)  # lazy imports, allocator, caches

    async def step(self, r: int) -> float:
        gc.collect()  # untimed: no round pays for garbage another made
        cpu, in_backend, self.moved = await _overhead_round(self.pages, self.seqs)
        self.figures["overhead"].append((cpu - in_backend) / self.moved * 1e6)
        self.figures["backend"].append(cpu / self.moved * 1e6)
        # Each page makes one device -> L3 -> device trip: four of the moves counted.
        self.figures["trip"].append((cpu - in_backend) / (self.moved // 4) * 1e6)
        return cpu

    def report(self) -> dict[str, float]:
        return {
            **spread("overhead_us_per_page", self.figures["overhead"], 2),
            **spread("with_backend_us_per_page", self.figures["backend"], 2),
            "overhead_pages_moved": self.moved,
            **spread("round_trip_us_per_page", self.figures["trip"], 2),
        }


async def _measure(
    overhead: _Overhead, pages: int, rounds: int, scratch: str, cpu: CpuLog
) -> tuple[dict[str, list[float]], int]:
    """Seconds of each step in each round, and the L3 page size. An overhead round opens every
    round, so a burst of load on the machine hits few of them, not a run of them."""
    shape = ModelShape(layers=16, heads=8, head_dim=64, page_size=64)  # 2 MiB bf16 pages
    ctl = await _build(shape, shape.page_size, 2 * pages, None)  # host pools, no L3
    url = f"file://{scratch}/controller"
    tier = await open_tier(ctl, _config(shape, url), url)
    try:
        raw = await open_backend(f"file://{scratch}/raw")
        try:
            host = ctl.anchor_host
            host.alloc(2 * pages)
            host.buffer.view(-1)[: pages * host.buffer[0].numel()].normal_()
            steps: dict[str, Step] = {
                "overhead": overhead.step,
                "controller": lambda r: roundtrip_controller(tier, ctl, pages, r, cpu),
                "raw": lambda r: roundtrip_raw(raw, ctl, pages, r, cpu),
            }
            await overhead.warm()
            for name in ("controller", "raw"):  # warm: directories, page cache, codec
                await steps[name](rounds)
            cpu.seconds = {side: [] for side in cpu.seconds}  # the warm-up's are not figures
            return await _timed_rounds(steps, rounds, first="overhead"), host.spec.page_bytes
        finally:
            await raw.close()
    finally:
        await close_tier(tier)
        await ctl.close()


def _check_sizes(args: argparse.Namespace) -> None:
    """What the parser's bounds on single flags cannot say: the sizes together."""
    if min(args.repeats, args.pages, args.overhead_pages, args.sequences) <= 0:
        raise ConfigError("repeats, pages, overhead pages and sequences must be positive")
    if args.overhead_pages * args.sequences > _MAX_OVERHEAD_TOTAL:
        raise ConfigError(
            f"--overhead-pages x --sequences must be at most {_MAX_OVERHEAD_TOTAL} pages"
        )
    check_memory(2 * args.pages * _L3_PAGE_BYTES, "2 x --pages x 2 MiB")  # written, read back


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    _check_sizes(args)
    overhead = _Overhead(args.overhead_pages, args.sequences)
    scratch = tempfile.mkdtemp(prefix="hicache-bench-ctl-", dir=args.dir)
    try:
        cpu = CpuLog()
        times, page_bytes = await _measure(overhead, args.pages, args.repeats, scratch, cpu)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "rounds": args.repeats,
        **overhead.report(),
        "memcpy_us_per_page": round(_memcpy_us_per_page(2 * 2 * 8 * 4 * 2), 3),
        **l3_report(times, args.pages, page_bytes),
        **cpu_report(cpu, args.pages),
    }


_FLAGS = (
    Flag("--overhead-pages", int_range(1, _MAX_OVERHEAD), 64, "pages per sequence"),
    Flag("--sequences", int_range(1, _MAX_OVERHEAD), 32),
    Flag("--pages", int_range(1, _MAX_PAGES), 128, "2 MiB pages in the L3 round trip"),
    repeats_flag(21, "rounds; each figure is their median, with its range"),
    scratch_dir_flag("scratch directory for the file L3 (default: temp)"),
    Flag.switch("--json"),
)


def add_bench_controller_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``controller`` to the ``hicache bench`` subcommands; ``run_bench_controller`` runs
    it."""
    help_text = "controller CPU overhead per page, and L3 round trip vs raw file I/O"
    return add_bench_parser(bench_subparsers, "controller", help_text, _FLAGS, run_bench_controller)


def run_bench_controller(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [asyncio.run(_run(args))]
