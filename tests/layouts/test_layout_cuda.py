"""CUDA: conversions on the device, gather/scatter with pinned host buffers, per-layer events."""

from __future__ import annotations

import pytest
import torch
from cuda_kit import needs_cuda
from layout_kit import PRESETS, every_preset_and_layout, random_buffer, small

from hicache.errors import LayoutError
from hicache.layouts import (
    Layout,
    LayoutSpec,
    SpecPreset,
    TransferStream,
    buffer_shape,
    conversions,
    convert,
    gather,
    scatter,
)

pytestmark = [pytest.mark.cuda, needs_cuda]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).cpu()


def page_slots(spec: LayoutSpec, pool_pages: torch.Tensor) -> torch.Tensor:
    return (pool_pages[:, None] * spec.page_size + torch.arange(spec.page_size)).reshape(-1)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("route", conversions(), ids=lambda r: f"{r[0].label}-{r[1].label}")
def test_convert_on_cuda_equals_cpu(preset: SpecPreset, route: tuple[Layout, Layout]) -> None:
    spec = small(preset)
    src = random_buffer(spec, route[0], 5, seed=1)
    on_gpu = convert(src.cuda(), spec, *route)
    assert on_gpu.device.type == "cuda"
    assert torch.equal(as_bytes(on_gpu), as_bytes(convert(src, spec, *route)))
    back = convert(on_gpu, spec, route[1], route[0])
    assert torch.equal(as_bytes(back), as_bytes(src))


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


@every_preset_and_layout
@pytest.mark.parametrize("aligned", [True, False], ids=["page_slots", "token_slots"])
def test_device_host_device_is_exact(preset: SpecPreset, layout: Layout, aligned: bool) -> None:
    spec = small(preset)
    gen = torch.Generator().manual_seed(7)
    pool_cpu = random_buffer(spec, Layout.LAYER_FIRST, 8, seed=2)
    pool = pool_cpu.cuda()
    host = _pinned(torch.zeros(buffer_shape(spec, layout, 6), dtype=pool.dtype))
    pages = torch.randperm(6, generator=gen)[:4]
    if aligned:
        slots = page_slots(spec, torch.randperm(8, generator=gen)[:4])
    else:
        slots = torch.randperm(8 * spec.page_size, generator=gen)[: 4 * spec.page_size]
    gather(pool, slots, host, pages, spec, layout).synchronize()
    # The host pages hold what the CPU path (a different copy plan) writes.
    expect = torch.zeros_like(host)
    gather(pool_cpu, slots, expect, pages, spec, layout)
    assert torch.equal(as_bytes(host), as_bytes(expect))
    fresh = torch.zeros_like(pool)
    scatter(host, pages, fresh, slots, spec, layout).synchronize()
    token_view = (spec.num_components, spec.layers, -1, spec.item_bytes)
    got = fresh.view(torch.uint8).view(token_view)[:, :, slots.cuda()]
    want = pool.view(torch.uint8).view(token_view)[:, :, slots.cuda()]
    assert torch.equal(got, want)


def test_layers_complete_in_order_and_wait_layer_orders_compute() -> None:
    spec = SpecPreset.MHA.spec(page_size=16, layers=8)
    pages = 64  # 8 MiB per layer: each layer's copy takes visible time
    host = _pinned(random_buffer(spec, Layout.PAGE_FIRST, pages, seed=3))
    pool = torch.zeros(buffer_shape(spec, Layout.LAYER_FIRST, pages), dtype=host.dtype).cuda()
    slots = torch.arange(pages * spec.page_size)
    stream = TransferStream("cuda")
    order = [5, 0, 7, 1, 2, 6, 3, 4]
    transfer = stream.scatter(host, list(range(pages)), pool, slots, spec, Layout.PAGE_FIRST, order)
    reference = convert(host, spec, Layout.PAGE_FIRST, Layout.LAYER_FIRST).cuda()
    for position, layer in enumerate(order):
        transfer.wait_layer(layer)  # the compute stream waits for this layer only
        seen = pool[:, layer].clone()
        assert torch.equal(seen.view(torch.uint8), reference[:, layer].view(torch.uint8))
        transfer.synchronize_layer(layer)
        assert all(transfer.layer_done(earlier) for earlier in order[: position + 1])
    transfer.synchronize()
    assert transfer.done()


def test_unpinned_host_is_refused_and_nothing_changes() -> None:
    spec = small(SpecPreset.MHA)
    pool = torch.ones(buffer_shape(spec, Layout.LAYER_FIRST, 2), dtype=torch.bfloat16).cuda()
    host = torch.zeros(buffer_shape(spec, Layout.PAGE_FIRST, 2), dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="pinned"):
        gather(pool, list(range(spec.page_size)), host, [0], spec, Layout.PAGE_FIRST)
    assert not host.any()


def test_bad_slots_on_cuda_change_nothing() -> None:
    spec = small(SpecPreset.MLA)
    pool = torch.ones(buffer_shape(spec, Layout.LAYER_FIRST, 2), dtype=torch.bfloat16).cuda()
    host = _pinned(torch.zeros(buffer_shape(spec, Layout.PAGE_FIRST_DIRECT, 2), dtype=pool.dtype))
    repeated = torch.tensor([0, 1, 1, 2], device="cuda")  # a CUDA index tensor is accepted too
    with pytest.raises(LayoutError, match="repeated"):
        gather(pool, repeated, host, [1], spec, Layout.PAGE_FIRST_DIRECT)
    with pytest.raises(LayoutError, match="out of range"):
        scatter(host, [0], pool, [5, 6, 7, 8], spec, Layout.PAGE_FIRST_DIRECT)
    assert not host.any()
    assert bool((pool == 1).all())
