"""``hicache bench layouts``: layout conversions, gather and scatter against plain copies.

Every row times one operation on ``bytes`` of KV and, in the same run and alternating with it,
a plain torch ``copy_`` of as many bytes on the same device: the ``baseline``. For a conversion
the baseline copies the source buffer's bytes into the target buffer's memory; for gather and
scatter on CUDA it is a pinned-memory copy (device to host, host to device) of one contiguous
block, the copy engine's speed; on the CPU a copy between the pool and the host buffer.
Gather and scatter move a random set of pages (page-aligned device slots, random host pages)
of all layers, with one event per layer. The two sides alternate, round after round: each GB/s
figure is the median of the rounds with its range, the ratio the median of the rounds' own
ratios with its range (``ratio_min``, ``ratio_max``). CPU runs use ``--threads``
threads (default 1: on a shared machine, a second thread is as often a stall as a gain).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.errors import InvalidArgumentError
from hicache.layouts import (
    KV_LAYOUTS,
    Axis,
    LayerTransfer,
    Layout,
    LayoutSpec,
    SpecPreset,
    TransferStream,
    axis_order,
    buffer_shape,
    conversions,
    convert,
)
from hicache.tools.bench.bench_flags import JSON_LINES, add_bench_parser, repeats_flag
from hicache.tools.bench.rounds import paired_ratio, rotated, spread
from hicache.tools.cli_parsing import Flag, add_flags, check_memory, int_range, size_range

__all__ = [
    "LayoutBenchConfig",
    "add_bench_layouts_parser",
    "main",
    "paired_rounds",
    "run_bench_layouts",
    "shared_run_bytes",
]

logger = logging.getLogger(__name__)

# Bounds of the flags. A row moves ``bytes`` (or one page, if larger) with up to four buffers
# of that size on the host, checked against this machine's memory before a run; a page of the
# widest preset at the largest page size is 512 MiB.
_MAX_PAGE_SIZE = 4096
_MAX_BYTES = 1 << 40
_MAX_THREADS = 1024


@dataclass(frozen=True, slots=True)
class LayoutBenchConfig:
    preset: SpecPreset = SpecPreset.MHA
    page_size: int = 32
    cpu_bytes: int = 64 << 20
    cuda_bytes: int = 1 << 30
    repeats: int = 7  # rounds: each figure is their median
    devices: tuple[str, ...] = ()  # empty: the CPU, and CUDA when there is one
    threads: int = 1  # CPU threads for torch

    def __post_init__(self) -> None:
        for name in ("page_size", "cpu_bytes", "cuda_bytes", "repeats", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        for device in self.devices:
            if device not in ("cpu", "cuda"):
                raise InvalidArgumentError(f"device must be cpu or cuda, not {device!r}")
        if "cuda" in self.devices and not torch.cuda.is_available():
            raise InvalidArgumentError("--device cuda asked for, but torch sees no CUDA device")

    def chosen_devices(self) -> tuple[str, ...]:
        if self.devices:
            return self.devices
        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def paired_rounds(
    steps: dict[str, Callable[[], object]], device: str, repeats: int
) -> dict[str, list[float]]:
    """Seconds of each step in each of ``repeats`` rounds, after one untimed warm-up each; the
    steps take turns going first."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(-1, repeats):
        for name in rotated(list(steps), max(r, 0)):
            _sync(device)
            start = time.perf_counter()
            steps[name]()
            _sync(device)
            if r >= 0:
                times[name].append(time.perf_counter() - start)
    return times


def _row(
    op: str, route: tuple[Layout, Layout], device: str, nbytes: int, times: dict[str, list[float]]
) -> dict[str, Any]:
    ours, base = times["op"], times["baseline"]
    row = {
        "op": op,
        "from": route[0].label,
        "to": route[1].label,
        "device": device,
        "bytes": nbytes,
        "rounds": len(ours),
        **spread("gbps", [nbytes / t / 1e9 for t in ours], 3),
        **spread("baseline_gbps", [nbytes / t / 1e9 for t in base], 3),
        **paired_ratio("ratio", ours, base),
    }
    floor = times.get("floor")
    if floor is not None:  # a transposing row: what a bare strided copy of its runs reaches
        row.update(spread("floor_gbps", [nbytes / t / 1e9 for t in floor], 3))
        row.update(paired_ratio("floor_ratio", ours, floor))
        row.update(paired_ratio("floor_of_baseline", floor, base))
    return row


def shared_run_bytes(spec: LayoutSpec, a: Layout, b: Layout) -> int | None:
    """Bytes that lie contiguous in both layouts (an item, or a page's tokens of one layer and
    component); None when the two are the same layout (nothing to transpose)."""
    if a is b:
        return None
    sizes = {
        Axis.COMPONENT: spec.num_components,
        Axis.LAYER: spec.layers,
        Axis.TOKEN: spec.page_size,
    }
    run = spec.item_bytes
    for x, y in zip(reversed(axis_order(a)), reversed(axis_order(b)), strict=True):
        if x is not y or x is Axis.PAGE:
            break
        run *= sizes[x]
    return run


def _floor_copy(src: torch.Tensor, dst: torch.Tensor, run: int, hops: int) -> Callable[[], object]:
    """A bare transposition of ``src`` into ``dst`` (flat, same size) in runs of ``run`` bytes,
    ``hops`` runs apart: the strided copy a layout change is, with nothing else around it."""
    word = 8 if run % 8 == 0 else 1
    words = run // word
    runs = src.numel() // run
    hops = hops if runs % hops == 0 else 1
    source = src.view(torch.int64 if word == 8 else torch.uint8).view(hops, runs // hops, words)
    target = dst.view(torch.int64 if word == 8 else torch.uint8).view(runs // hops, hops, words)
    return lambda: target.copy_(source.transpose(0, 1))


def _random_bytes(nbytes: int, device: str, pin: bool = False) -> torch.Tensor:
    out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    out.random_(0, 256, generator=torch.Generator().manual_seed(nbytes))
    return out.to(device) if device != "cpu" else out


def _as_layout(flat: torch.Tensor, spec: LayoutSpec, layout: Layout, pages: int) -> torch.Tensor:
    return flat.view(spec.dtype.to_torch()).view(buffer_shape(spec, layout, pages))


def _bench_convert(spec: LayoutSpec, pages: int, device: str, repeats: int) -> list[dict[str, Any]]:
    nbytes = pages * spec.page_bytes
    src_flat = _random_bytes(nbytes, device)
    dst_flat = torch.empty_like(src_flat)
    rows = []
    for route in conversions():
        src = _as_layout(src_flat, spec, route[0], pages)
        dst = _as_layout(dst_flat, spec, route[1], pages)
        convert(src, spec, *route, out=dst)
        back = convert(dst, spec, route[1], route[0]).view(-1).view(torch.uint8)
        if not torch.equal(back, src_flat):
            raise RuntimeError(f"{route}: round trip mismatch")  # a wrong result is no figure
        steps: dict[str, Callable[[], object]] = {
            "op": functools.partial(convert, src, spec, route[0], route[1], out=dst),
            "baseline": lambda: dst_flat.copy_(src_flat),
        }
        run = shared_run_bytes(spec, *route)
        if run is not None and nbytes % run == 0:
            hops = spec.num_components * spec.layers
            steps["floor"] = _floor_copy(src_flat, dst_flat, run, hops)
        times = paired_rounds(steps, device, repeats)
        rows.append(_row("convert", route, device, nbytes, times))
    return rows


def _transfer(run: Callable[..., LayerTransfer], args: tuple[Any, ...]) -> None:
    run(*args).synchronize()


def _bench_transfers(
    spec: LayoutSpec, pages: int, device: str, repeats: int
) -> list[dict[str, Any]]:
    """Gather and scatter ``pages`` random pages between a 2x pool and a 2x host buffer."""
    nbytes = pages * spec.page_bytes
    pool_flat = _random_bytes(2 * nbytes, device)
    host_flat = _random_bytes(2 * nbytes, "cpu", pin=device == "cuda")
    pool = _as_layout(pool_flat, spec, Layout.LAYER_FIRST, 2 * pages)
    gen = torch.Generator().manual_seed(pages)
    pool_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    slots = (pool_pages[:, None] * spec.page_size + torch.arange(spec.page_size)).reshape(-1)
    host_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    stream = TransferStream(device)
    # The copy engine's speed for as many bytes: one block, pool <-> host memory.
    to_host = lambda: host_flat[:nbytes].copy_(pool_flat[:nbytes], non_blocking=True)  # noqa: E731
    to_pool = lambda: pool_flat[:nbytes].copy_(host_flat[:nbytes], non_blocking=True)  # noqa: E731
    rows = []
    hops = spec.num_components * spec.layers
    for layout in KV_LAYOUTS:
        host = _as_layout(host_flat, spec, layout, 2 * pages)
        # On the CPU, a transposing layout's floor: its runs copied bare, between the same
        # buffers (a GPU's copies are the copy engine's, whose floor is the block copy).
        run = shared_run_bytes(spec, Layout.LAYER_FIRST, layout) if device == "cpu" else None
        floor = run if run is not None and nbytes % run == 0 else None
        args = (pool, slots, host, host_pages, spec, layout)
        steps: dict[str, Callable[[], object]] = {
            "op": functools.partial(_transfer, stream.gather, args),
            "baseline": to_host,
        }
        if floor:
            steps["floor"] = _floor_copy(pool_flat[:nbytes], host_flat[:nbytes], floor, hops)
        times = paired_rounds(steps, device, repeats)
        rows.append(_row("gather", (Layout.LAYER_FIRST, layout), device, nbytes, times))
        args = (host, host_pages, pool, slots, spec, layout)
        steps = {"op": functools.partial(_transfer, stream.scatter, args), "baseline": to_pool}
        if floor:
            steps["floor"] = _floor_copy(host_flat[:nbytes], pool_flat[:nbytes], floor, hops)
        times = paired_rounds(steps, device, repeats)
        rows.append(_row("scatter", (layout, Layout.LAYER_FIRST), device, nbytes, times))
    return rows


def run_layout_bench(config: LayoutBenchConfig) -> list[dict[str, Any]]:
    """Every conversion pair, then gather and scatter per layout, on each device."""
    spec = config.preset.spec(config.page_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run_devices(config, spec)
    finally:
        torch.set_num_threads(threads)


def _run_devices(config: LayoutBenchConfig, spec: LayoutSpec) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for device in config.chosen_devices():
        budget = config.cuda_bytes if device == "cuda" else config.cpu_bytes
        pages = max(1, budget // spec.page_bytes)
        logger.info("%s: %d pages of %d bytes", device, pages, spec.page_bytes)
        about = {"preset": config.preset.value, "page_size": config.page_size, "pages": pages}
        for row in _bench_convert(spec, pages, device, config.repeats) + _bench_transfers(
            spec, pages, device, config.repeats
        ):
            rows.append({**row, **about})
    return rows


_OPERATION_BYTES = size_range(1, _MAX_BYTES)  # on the CPU and on CUDA alike
# The options of `hicache bench layouts` and of main() below.
_FLAGS = (
    Flag.choice(
        "--preset", SpecPreset, SpecPreset.MHA,
        "model shape of the pool (default: mha, Llama-3-8B-like)",
    ),
    Flag("--page-size", int_range(1, _MAX_PAGE_SIZE), 32, "tokens per page (default 32)"),
    Flag("--bytes", _OPERATION_BYTES, 64 << 20, "bytes per operation on the CPU (e.g. 64M)"),
    Flag("--cuda-bytes", _OPERATION_BYTES, 1 << 30, "bytes per operation on CUDA (e.g. 1G)"),
    repeats_flag(7, "rounds; each figure is their median, with its range (default 7)"),
    Flag(
        "--device", action="append", choices=["cpu", "cuda"],
        help="repeatable (default: cpu, and cuda when available)",
    ),
    Flag("--threads", int_range(1, _MAX_THREADS), 1, "torch CPU threads (default 1)"),
    JSON_LINES,
)  # fmt: skip


def add_bench_layouts_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``layouts`` to the ``hicache bench`` subcommands; ``run_bench_layouts`` runs it."""
    help_text = "layout conversions, gather and scatter vs a plain copy of the same bytes"
    return add_bench_parser(bench_subparsers, "layouts", help_text, _FLAGS, run_bench_layouts)


def run_bench_layouts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``hicache bench layouts`` from parsed arguments."""
    config = LayoutBenchConfig(
        preset=SpecPreset(args.preset),
        page_size=args.page_size,
        cpu_bytes=args.bytes,
        cuda_bytes=args.cuda_bytes,
        repeats=args.repeats,
        devices=tuple(args.device or ()),
        threads=args.threads,
    )
    _check_host_memory(config)
    return run_layout_bench(config)


def _check_host_memory(config: LayoutBenchConfig) -> None:
    """Refuse sizes whose host buffers would not fit: on the CPU a pool and a host buffer of
    twice the bytes each; for CUDA, the pinned host buffer of twice the bytes."""
    page_bytes = config.preset.spec(config.page_size).page_bytes
    devices = config.chosen_devices()
    if "cpu" in devices:
        check_memory(4 * max(config.cpu_bytes, page_bytes), "4 x --bytes (or 4 pages)")
    if "cuda" in devices:
        check_memory(2 * max(config.cuda_bytes, page_bytes), "2 x --cuda-bytes (or 2 pages)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hicache.tools.bench.cache.layouts``: the same benchmark without the CLI."""
    parser = argparse.ArgumentParser(prog="hicache-bench-layouts", description=__doc__)
    add_flags(parser, _FLAGS)
    args = parser.parse_args(argv)
    for row in run_bench_layouts(args):
        line = json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items())
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
