"""The cache-side measurements of ``hicache bench seed``: host <-> L3 I/O by host layout, SLRU
against LRU, and the CUDA I/O kernel (see :mod:`hicache.tools.bench.seed.seed` for the fields).

``layout_host_io`` moves 2 MiB pages from host memory to a ``disk://`` L3 (in ``/dev/shm``
unless ``--dir`` names another place) and back through the controller's storage tier
(:func:`~hicache.tools.bench.cache.controller_l3.roundtrip_controller`, the path ``hicache serve``
writes and prefetches by), once with ``page_first`` host pools and once with ``layer_first``
ones, alternating round by round. ``slru_vs_lru`` replays one
generated trace through the radix tree (:func:`~hicache.tools.bench.cache.radix.bench_trace`) with
each policy at the same capacity.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
from typing import Any

import torch

from hicache.layouts import Layout
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.radix import EvictionPolicy, RadixCache, RadixCacheConfig
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig
from hicache.tiering.controller import HiCacheController
from hicache.tiering.l3.storage_tier import StorageTier
from hicache.tools.bench.cache.controller_l3 import (
    BATCH_PAGES,
    CpuLog,
    close_tier,
    open_tier,
    roundtrip_controller,
)
from hicache.tools.bench.cache.radix import RadixBenchConfig, bench_trace, prepare_steps, replay
from hicache.tools.bench.rounds import rotated, spread
from hicache.workloads.synthetic import WorkloadConfig, WorkloadKind, generate_trace

__all__ = ["io_kernel", "layout_host_io", "slru_vs_lru"]

# 2 MiB bf16 pages (16 layers, 8 KV heads of 64, 64 tokens): the controller bench's L3 pages.
# A layer_first page is 32 pieces of 64 KiB (K and V of each layer).
_IO_SHAPE = ModelShape(layers=16, heads=8, head_dim=64, page_size=64)
_LAYOUTS = {layout.label: layout for layout in (Layout.PAGE_FIRST, Layout.LAYER_FIRST)}
_MEMORY_DIR = "/dev/shm"
_PAGE_SIZE = 16  # of the SLRU replay: hicache serve's default page size


async def _open_controller(
    layout: Layout, pages: int, url: str
) -> tuple[StorageTier, HiCacheController]:
    """A controller over ``2 * pages`` host pages in ``layout``, and a storage tier over them
    and an L3 at ``url`` (:func:`~hicache.tools.bench.cache.controller_l3.open_tier`)."""
    model = preset(PoolPreset.DENSE, _IO_SHAPE)
    storage = StorageConfig(
        url=url, required=True, write_batch_pages=BATCH_PAGES, write_queue_pages=1 << 20
    )
    device = device_pools(model, {"kv": _IO_SHAPE.page_size}, "cpu")
    host = host_pools(model, {"kv": 2 * pages}, layout, pin_memory=False)
    prefetch = PrefetchConfig(threshold_tokens=_IO_SHAPE.page_size, batch_pages=BATCH_PAGES)
    config = HiCacheConfig(storage=storage, prefetch=prefetch)
    ctl = await HiCacheController.open(config.with_changes("storage", url=None), device, host)
    ctl.anchor_host.alloc(2 * pages)
    ctl.anchor_host.buffer.normal_(generator=torch.Generator().manual_seed(pages))
    return await open_tier(ctl, config, url), ctl


async def _layout_rounds(pages: int, rounds: int, scratch: str) -> dict[str, list[float]]:
    """Seconds of each layout's round trip in each round, after one untimed round each."""
    sides = {
        label: await _open_controller(layout, pages, f"disk://{scratch}/{label}")
        for label, layout in _LAYOUTS.items()
    }
    cpu = CpuLog()
    times: dict[str, list[float]] = {label: [] for label in _LAYOUTS}
    try:
        for r in range(-1, rounds):
            for layout in rotated(list(_LAYOUTS), max(r, 0)):
                await asyncio.to_thread(os.sync)  # no side pays for the other's writeback
                seconds = await roundtrip_controller(*sides[layout], pages, r + 1, cpu)
                if r >= 0:
                    times[layout].append(seconds)
    finally:
        for tier, ctl in sides.values():
            await close_tier(tier)
            await ctl.close()
    return times


def _scratch_parent(directory: str | None) -> str:
    """Where the L3 lives: ``directory``, else memory (``/dev/shm``) when this machine has it,
    else the temp directory. On a virtual disk the disk's writeback, not the layout, decides
    the figure (rounds of the same command ranged 0.3-4.8 there, 1.1-2.1 in memory)."""
    if directory is not None:
        return directory
    if os.path.isdir(_MEMORY_DIR) and os.access(_MEMORY_DIR, os.W_OK):
        return _MEMORY_DIR
    return tempfile.gettempdir()


def layout_host_io(pages: int, rounds: int, directory: str | None) -> dict[str, Any]:
    """Bytes/s of ``pages`` pages host -> L3 -> host, page_first over layer_first host pools."""
    parent = _scratch_parent(directory)
    scratch = tempfile.mkdtemp(prefix="hicache-bench-seed-", dir=parent)
    try:
        times = asyncio.run(_layout_rounds(pages, rounds, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    page_bytes = preset(PoolPreset.DENSE, _IO_SHAPE).pool("kv").page_bytes
    moved = 2 * pages * page_bytes  # written, then read back
    first, layer = times[Layout.PAGE_FIRST.label], times[Layout.LAYER_FIRST.label]
    return {
        **spread("ratio", [lay / pf for pf, lay in zip(first, layer, strict=True)], 3),
        "page_first_bytes_s": round(moved / statistics.median(first)),
        "layer_first_bytes_s": round(moved / statistics.median(layer)),
        "page_bytes": page_bytes,
        "pages": pages,
        "rounds": rounds,
        "l3": f"disk:// under {parent}",
    }


def slru_vs_lru(clients: int, rounds: int, capacity_share: float) -> dict[str, Any]:
    """Hit rates of SLRU and LRU replaying the multi-turn trace at ``capacity_share`` of the
    tokens an unbounded replay ends with."""
    requests = generate_trace(WorkloadConfig(WorkloadKind.MULTITURN, clients, rounds))
    steps = prepare_steps(requests, _PAGE_SIZE)
    unbounded = RadixCache(RadixCacheConfig(_PAGE_SIZE, simulated=True))
    unbounded_hits, _ = replay(unbounded, steps, 0)
    capacity = max(_PAGE_SIZE, int(unbounded.total_size * capacity_share))
    rates = {
        policy: bench_trace(requests, RadixBenchConfig(_PAGE_SIZE, policy, capacity, 1))
        for policy in (EvictionPolicy.SLRU, EvictionPolicy.LRU)
    }
    slru, lru = rates[EvictionPolicy.SLRU], rates[EvictionPolicy.LRU]
    prompt_tokens = slru["prompt_tokens"]
    return {
        "ratio": round(slru["hit_rate"] / lru["hit_rate"], 3) if lru["hit_rate"] else None,
        "hit_rate_slru": slru["hit_rate"],
        "hit_rate_lru": lru["hit_rate"],
        "hit_rate_unbounded": round(unbounded_hits / prompt_tokens, 4),
        "evicted_tokens_slru": slru["evicted_tokens"],
        "evicted_tokens_lru": lru["evicted_tokens"],
        "capacity_tokens": capacity,
        "requests": len(requests),
        "workload": WorkloadKind.MULTITURN.value,
        "page_size": _PAGE_SIZE,
    }


def io_kernel(pages: int, repeats: int) -> dict[str, Any]:
    """The CUDA I/O kernel against a per-page ``cudaMemcpyAsync`` loop (``ratio``: the lower
    of gather's and scatter's; :mod:`hicache.tools.bench.cache.io_kernel`); skipped without CUDA."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    from hicache.tools.bench.cache.io_kernel import kernel_vs_page_loop

    return kernel_vs_page_loop("cuda", pages, repeats)
