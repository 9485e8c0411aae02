"""The I/O kernel against a per-page copy loop: ``io_kernel`` of ``hicache bench seed``.

The seed measures its transfer kernels at about 3x a loop of ``cudaMemcpyAsync`` calls, one
per page, layer and K/V. Here both sides move the same random pages between a ``layer_first``
device pool and a ``page_first_direct`` host buffer (pinned on CUDA), where each (page, K or V,
layer) block is contiguous on both ends, so the loop is the best a per-page copy can do:

* ``kernel``: :class:`~hicache.layouts.TransferStream`'s ``gather`` (device to host) and
  ``scatter`` (host to device), one copy per layer over every page, as the controller moves
  pages;
* ``page_loop``: one ``copy_(non_blocking=True)`` per block, issued from Python on the same
  stream (on CUDA each is one ``cudaMemcpyAsync``; Python's call costs more than C++'s, so the
  loop's issue rate, not only its copies, is in its time).

The two alternate round by round after a warm-up; ``ratio`` is the median of the rounds'
``page_loop`` seconds over ``kernel`` seconds, with its range; ``kernel_gbps`` and
``page_loop_gbps`` are each side's best round. It runs on the CPU too (the tests
do), where it says little: both sides are memcpy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from hicache.layouts import Layout, LayoutSpec, SpecPreset, TransferStream, buffer_shape
from hicache.tools.bench.cache.layouts import paired_rounds
from hicache.tools.bench.rounds import paired_ratio

__all__ = ["kernel_vs_page_loop"]

_HOST = Layout.PAGE_FIRST_DIRECT  # (page, component, layer, token): a block per copy


@dataclass(frozen=True, slots=True)
class _Buffers:
    """Both sides' buffers and the random pages they move: ``pool_pages`` (and their
    ``slots``) of the device pool, ``host_pages`` of the host buffer."""

    spec: LayoutSpec
    pool: torch.Tensor
    host: torch.Tensor
    slots: torch.Tensor
    pool_pages: list[int]
    host_pages: list[int]


def _buffers(device: str, pages: int, page_size: int, layers: int | None) -> _Buffers:
    spec = SpecPreset.MHA.spec(page_size, layers)
    dtype = spec.dtype.to_torch()
    pool = torch.empty(buffer_shape(spec, Layout.LAYER_FIRST, 2 * pages), dtype=dtype)
    host = torch.empty(
        buffer_shape(spec, _HOST, 2 * pages), dtype=dtype, pin_memory=device == "cuda"
    )
    gen = torch.Generator().manual_seed(pages)
    pool.view(torch.uint8).random_(0, 256, generator=gen)
    host.view(torch.uint8).random_(0, 256, generator=gen)
    pool_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    host_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    slots = (pool_pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return _Buffers(spec, pool.to(device), host, slots, pool_pages.tolist(), host_pages.tolist())


def _kernel(stream: TransferStream, b: _Buffers, to_host: bool) -> None:
    if to_host:
        stream.gather(b.pool, b.slots, b.host, b.host_pages, b.spec, _HOST)
    else:
        stream.scatter(b.host, b.host_pages, b.pool, b.slots, b.spec, _HOST)
    stream.synchronize()


def _page_loop(stream: TransferStream, b: _Buffers, to_host: bool) -> None:
    spec, ps = b.spec, b.spec.page_size
    with torch.cuda.stream(stream.stream) if stream.stream is not None else nullcontext():
        for pool_page, host_page in zip(b.pool_pages, b.host_pages, strict=True):
            lo = pool_page * ps
            for c in range(spec.num_components):
                for layer in range(spec.layers):
                    device_block = b.pool[c, layer, lo : lo + ps]
                    host_block = b.host[host_page, c, layer]
                    if to_host:
                        host_block.copy_(device_block, non_blocking=True)
                    else:
                        device_block.copy_(host_block, non_blocking=True)
    stream.synchronize()


def kernel_vs_page_loop(
    device: str, pages: int, repeats: int, page_size: int = 32, layers: int | None = None
) -> dict[str, Any]:
    """Gather and scatter of ``pages`` pages (Llama-3-8B's pool at ``page_size``; ``layers``
    overrides its 32): the kernel against the per-page loop, ``repeats`` paired rounds."""
    b = _buffers(device, pages, page_size, layers)
    stream = TransferStream(device)
    spec = b.spec
    out: dict[str, Any] = {
        "device": device,
        "pages": pages,
        "page_bytes": spec.page_bytes,
        "copies_per_page": spec.num_components * spec.layers,
    }
    for op, to_host in (("gather", True), ("scatter", False)):
        steps: dict[str, Callable[[], object]] = {
            "kernel": functools.partial(_kernel, stream, b, to_host),
            "page_loop": functools.partial(_page_loop, stream, b, to_host),
        }
        times = paired_rounds(steps, device, repeats)
        nbytes = pages * spec.page_bytes
        out[op] = {
            **paired_ratio("ratio", times["kernel"], times["page_loop"]),
            "kernel_gbps": round(nbytes / min(times["kernel"]) / 1e9, 2),
            "page_loop_gbps": round(nbytes / min(times["page_loop"]) / 1e9, 2),
        }
    out["ratio"] = min(out["gather"]["ratio"], out["scatter"]["ratio"])
    return out
