"""The L3 round trip of ``hicache bench controller``: 2 MiB pages from host memory to a file L3
and back through the controller's storage tier, against the raw file backend moving the same
page bytes under plain keys; wall time and process CPU time of each side, per round."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from hicache.backends.base import StorageBackend
from hicache.backends.registry import open_backend
from hicache.layouts import Layout
from hicache.tiering.common.config import HiCacheConfig
from hicache.tiering.common.metrics import HiCacheMetrics
from hicache.tiering.controller import HiCacheController, storage_tier
from hicache.tiering.l3.bundler import BundlePage
from hicache.tiering.l3.storage_tier import PrefetchOp, StorageTier, WriteJob
from hicache.tools.bench.rounds import spread

__all__ = [
    "BATCH_PAGES",
    "CpuLog",
    "close_tier",
    "cpu_report",
    "host_page_range",
    "l3_report",
    "open_tier",
    "roundtrip_controller",
    "roundtrip_raw",
]

BATCH_PAGES = 32  # pages per backend call, for the controller and the raw baseline alike


def _bundle(ctl: HiCacheController, pages: int, tag: int) -> list[BundlePage]:
    """A chain of ``pages`` pages on host pages 0 .. pages - 1, with hashes of round ``tag``."""
    names = list(ctl.host_pools)
    hashes = [(tag * 1_000_003 + i + 1).to_bytes(8, "little") * 4 for i in range(pages)]
    return [
        BundlePage(bytes(32), h, dict.fromkeys(names, i), i, hashes[i - 1] if i else bytes(32))
        for i, h in enumerate(hashes)
    ]


def _leading_whole_pages(found: list[dict[str, bool]]) -> int:
    """The prefetch plan of a single-pool model: pages up to the first with an object missing."""
    for i, page in enumerate(found):
        if not all(page.values()):
            return i
    return len(found)


class CpuLog:
    """Process CPU seconds of each timed L3 side, per round (every thread's: the file
    backend's I/O threads copy the bytes, the loop checks them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {"controller": [], "raw": []}
        self._start = 0.0

    def start(self) -> None:
        self._start = time.process_time()

    def stop(self, side: str) -> None:
        self.seconds[side].append(time.process_time() - self._start)


async def open_tier(ctl: HiCacheController, config: HiCacheConfig, url: str) -> StorageTier:
    """The controller's host <-> L3 path alone: a storage tier over ``ctl``'s host pools (a
    controller without L3 of its own) and the backend at ``url``, built as a controller builds
    its own (:func:`~hicache.tiering.controller.storage_tier`), with counters of its own."""
    tier = storage_tier(config, ctl.host_pools, HiCacheMetrics())
    tier.start(await open_backend(url))
    return tier


async def close_tier(tier: StorageTier) -> None:
    backend = tier.backend
    await tier.stop()
    if backend is not None:
        await backend.close()


async def roundtrip_controller(
    storage: StorageTier, ctl: HiCacheController, pages: int, tag: int, cpu: CpuLog
) -> float:
    """Seconds of ``pages`` host pages of ``ctl`` written to L3 through ``storage`` and read
    back (into the host pool's second half)."""
    names = list(ctl.host_pools)
    bundle = _bundle(ctl, pages, tag)
    _clear_dest(ctl, pages)
    cpu.start()
    start = time.perf_counter()
    job = WriteJob(bundle, 1.0)
    storage.submit_write(job)
    while job.ok is None:
        await storage.wait_for_activity(1.0)
    if not all(job.ok):
        raise RuntimeError("a controller L3 write failed during the benchmark")
    candidates = [dataclasses.replace(p, host_pages=dict.fromkeys(names, -1)) for p in bundle]

    def grant(n: int) -> list[BundlePage]:  # read back into the second half of the host pool
        return [
            dataclasses.replace(p, host_pages=dict.fromkeys(names, pages + i))
            for i, p in enumerate(candidates[:n])
        ]

    op = PrefetchOp("bench", candidates, grant, time.monotonic(), _leading_whole_pages)
    storage.start_prefetch(op)
    while not op.reads_finished:
        await storage.wait_for_activity(1.0)
    seconds = time.perf_counter() - start
    cpu.stop("controller")
    if op.completed_pages != pages:
        raise RuntimeError(f"controller read back {op.completed_pages} of {pages} pages")
    storage.write_acks.clear()
    storage.finished_prefetches.clear()
    _check_read_back(ctl, pages, "the controller")
    assert storage.backend is not None
    await _empty(storage.backend)
    return seconds


async def roundtrip_raw(
    backend: StorageBackend, ctl: HiCacheController, pages: int, tag: int, cpu: CpuLog
) -> float:
    host = ctl.anchor_host
    keys = [f"raw-{tag}-{i:06d}" for i in range(pages)]
    _clear_dest(ctl, pages)
    cpu.start()
    start = time.perf_counter()
    for lo in range(0, pages, BATCH_PAGES):
        batch = range(lo, min(lo + BATCH_PAGES, pages))
        values = [host.page_segments(i) for i in batch]
        if not all(await backend.put([keys[i] for i in batch], values)):
            raise RuntimeError("a raw put failed during the benchmark")
    for lo in range(0, pages, BATCH_PAGES):
        batch = range(lo, min(lo + BATCH_PAGES, pages))
        got = await backend.get_into(
            [keys[i] for i in batch], [host.page_segments(pages + i) for i in batch]
        )
        if min(got) < 0:
            raise RuntimeError("a raw get missed during the benchmark")
    seconds = time.perf_counter() - start
    cpu.stop("raw")
    _check_read_back(ctl, pages, "the raw baseline")
    await _empty(backend)
    return seconds


def host_page_range(ctl: HiCacheController, lo: int, hi: int) -> torch.Tensor:
    """Host pages ``lo .. hi - 1`` of the anchor pool, a view in the pool's layout
    (``layer_first`` holds a page's tokens along dim 2, the page_first family along dim 0)."""
    host = ctl.anchor_host
    if host.layout is Layout.LAYER_FIRST:
        return host.buffer[:, :, lo * host.page_size : hi * host.page_size]
    return host.buffer[lo:hi]


def _clear_dest(ctl: HiCacheController, pages: int) -> None:
    """Zero the host pages read into (untimed), so a side cannot pass on the other's data."""
    host_page_range(ctl, pages, 2 * pages).zero_()


def _check_read_back(ctl: HiCacheController, pages: int, who: str) -> None:
    if not torch.equal(host_page_range(ctl, 0, pages), host_page_range(ctl, pages, 2 * pages)):
        raise RuntimeError(f"pages read back through {who} differ from those written")


async def _empty(backend: StorageBackend) -> None:
    """Delete every object of a side's own store (untimed): each round starts from empty."""
    keys = [info.key async for info in backend.scan("")]
    if keys and not all(await backend.delete(keys)):
        raise RuntimeError("the benchmark could not delete its objects")


def l3_report(times: dict[str, list[float]], pages: int, page_bytes: int) -> dict[str, float]:
    moved = 2 * pages * page_bytes / 1e9
    ctl_s, raw_s = times["controller"], times["raw"]
    # Each side's median time, so a slow step on either side is one outlier of its own side,
    # not an outlier ratio; the range is that of the rounds' own ratios.
    ratios = [raw / ctl for ctl, raw in zip(ctl_s, raw_s, strict=True)]
    return {
        "page_bytes": page_bytes,
        "pages": pages,
        **spread("l3_roundtrip_gbps", [moved / t for t in ctl_s], 3),
        **spread("raw_roundtrip_gbps", [moved / t for t in raw_s], 3),
        "l3_roundtrip_ratio": round(statistics.median(raw_s) / statistics.median(ctl_s), 3),
        "l3_roundtrip_ratio_min": round(min(ratios), 3),
        "l3_roundtrip_ratio_max": round(max(ratios), 3),
    }


def cpu_report(cpu: CpuLog, pages: int) -> dict[str, float]:
    """CPU microseconds per page of each L3 side's round trip (a page written and read back):
    less moved by the disk's noise than the wall time, and their difference is what the
    controller adds (codec checksums, keys, existence checks, tasks)."""
    per_page = {side: [t / pages * 1e6 for t in ts] for side, ts in cpu.seconds.items()}
    extra = [c - r for c, r in zip(per_page["controller"], per_page["raw"], strict=True)]
    return {
        **spread("l3_roundtrip_cpu_us_per_page", per_page["controller"], 1),
        **spread("raw_roundtrip_cpu_us_per_page", per_page["raw"], 1),
        **spread("l3_roundtrip_extra_cpu_us_per_page", extra, 1),
    }
