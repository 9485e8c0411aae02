"""gather/scatter on the CPU: every preset and layout, random page sets, per-layer events, bad
input leaving every buffer unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_kit import every_preset_and_layout, random_buffer, small

from hicache.errors import LayoutError
from hicache.layouts import (
    KV_LAYOUTS,
    Layout,
    LayoutSpec,
    SpecPreset,
    TransferStream,
    buffer_shape,
    gather,
    scatter,
)
from hicache.pools import TokenSlotAllocator

POOL_PAGES, HOST_PAGES = 8, 6


def zeros(spec: LayoutSpec, layout: Layout, pages: int) -> torch.Tensor:
    return torch.zeros(buffer_shape(spec, layout, pages), dtype=spec.dtype.to_torch())


def host_page(host: torch.Tensor, spec: LayoutSpec, layout: Layout, page: int) -> torch.Tensor:
    """Host page as (C, L, T, item bytes), by indexing the documented shapes directly."""
    t = spec.page_size
    if layout is Layout.LAYER_FIRST:
        x = host[:, :, page * t : (page + 1) * t]
    elif layout is Layout.PAGE_FIRST:
        x = host[page].transpose(1, 2)
    else:
        x = host[page]
    return x.contiguous().view(torch.uint8).view(*x.shape[:3], -1)


def pool_pages(pool: torch.Tensor, spec: LayoutSpec, slots: torch.Tensor) -> torch.Tensor:
    """The pool's items at ``slots``, grouped per page: (n, C, L, T, item bytes)."""
    c, layers = spec.num_components, spec.layers
    items = pool.view(torch.uint8).view(c, layers, -1, spec.item_bytes)[:, :, slots]
    return items.view(c, layers, -1, spec.page_size, spec.item_bytes).permute(2, 0, 1, 3, 4)


def choose(spec: LayoutSpec, n: int, aligned: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random host pages and their device slots: whole random pool pages or, unaligned,
    random single slots (the other copy plan)."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(HOST_PAGES, generator=gen)[:n]
    if aligned:
        pool_pages = torch.randperm(POOL_PAGES, generator=gen)[:n]
        slots = (pool_pages[:, None] * spec.page_size + torch.arange(spec.page_size)).reshape(-1)
    else:
        slots = torch.randperm(POOL_PAGES * spec.page_size, generator=gen)[: n * spec.page_size]
    return pages, slots


@every_preset_and_layout
@pytest.mark.parametrize("aligned", [True, False], ids=["page_slots", "token_slots"])
def test_device_to_host_to_device_is_exact(
    preset: SpecPreset, layout: Layout, aligned: bool
) -> None:
    spec = small(preset)
    pool = random_buffer(spec, Layout.LAYER_FIRST, POOL_PAGES, seed=1)
    host = zeros(spec, layout, HOST_PAGES)
    pages, slots = choose(spec, 4, aligned, seed=2)
    transfer = gather(pool, slots, host, pages, spec, layout)
    assert transfer.done() and transfer.layers == (0, 1, 2)
    want = pool_pages(pool, spec, slots)
    for i, page in enumerate(pages.tolist()):
        assert torch.equal(host_page(host, spec, layout, page), want[i])
    for page in set(range(HOST_PAGES)) - set(pages.tolist()):
        assert not host_page(host, spec, layout, page).any()
    fresh = zeros(spec, Layout.LAYER_FIRST, POOL_PAGES)
    scatter(host, pages, fresh, slots, spec, layout).synchronize()
    assert torch.equal(pool_pages(fresh, spec, slots), want)
    untouched = torch.ones(POOL_PAGES * spec.page_size, dtype=torch.bool)
    untouched[slots] = False
    assert not fresh.view(torch.uint8).view(*fresh.shape[:3], -1)[:, :, untouched].any()


def test_allocator_slots_use_the_page_plan_and_scattered_slots_the_row_plan() -> None:
    from hicache.layouts._plans import PagePlan, RowPlan, make_plan

    spec = SpecPreset.MHA.spec(page_size=4, layers=2)
    allocator = TokenSlotAllocator(POOL_PAGES * spec.page_size, spec.page_size)
    allocator.alloc(8)  # the next pages are not the first ones
    slots = allocator.alloc(3 * spec.page_size)
    assert slots is not None
    pool = random_buffer(spec, Layout.LAYER_FIRST, POOL_PAGES, seed=3)
    host = zeros(spec, Layout.PAGE_FIRST, HOST_PAGES)
    args = (host, [5, 0, 2], spec, Layout.PAGE_FIRST, None)
    assert isinstance(make_plan(pool, slots, *args), PagePlan)
    assert isinstance(make_plan(pool, slots.flip(0), *args), RowPlan)
    gather(pool, slots, host, [5, 0, 2], spec, Layout.PAGE_FIRST)
    want = pool_pages(pool, spec, slots)
    for i, page in enumerate((5, 0, 2)):
        assert torch.equal(host_page(host, spec, Layout.PAGE_FIRST, page), want[i])


@pytest.mark.parametrize("aligned", [True, False], ids=["page_slots", "token_slots"])
def test_chosen_layers_only_in_the_order_given(aligned: bool) -> None:
    spec = SpecPreset.MLA.spec(page_size=2, layers=4)
    pool = random_buffer(spec, Layout.LAYER_FIRST, POOL_PAGES, seed=4)
    host = zeros(spec, Layout.PAGE_FIRST_DIRECT, HOST_PAGES)
    pages, slots = choose(spec, 3, aligned, seed=5)
    stream = TransferStream()
    transfer = stream.gather(pool, slots, host, pages, spec, Layout.PAGE_FIRST_DIRECT, [3, 1])
    assert transfer.layers == (3, 1)
    for layer in (3, 1):
        transfer.wait_layer(layer)
        transfer.synchronize_layer(layer)
        assert transfer.layer_done(layer)
    with pytest.raises(LayoutError, match="not part"):
        transfer.event(0)
    want = pool_pages(pool, spec, slots)
    for i, page in enumerate(pages.tolist()):
        got = host_page(host, spec, Layout.PAGE_FIRST_DIRECT, page)
        assert torch.equal(got[:, [1, 3]], want[i][:, [1, 3]])
        assert not got[:, [0, 2]].any()


def test_per_layer_loads_arrive_layer_by_layer() -> None:
    """Loading layer by layer (as a forward pass consumes them): after each load that layer,
    and only the layers loaded so far, hold the pages."""
    spec = SpecPreset.MHA.spec(page_size=4, layers=4)
    host = random_buffer(spec, Layout.PAGE_FIRST, HOST_PAGES, seed=6)
    pool = zeros(spec, Layout.LAYER_FIRST, POOL_PAGES)
    pages, slots = choose(spec, 5, aligned=True, seed=7)
    stream = TransferStream("cpu")
    expected = torch.stack([host_page(host, spec, Layout.PAGE_FIRST, p) for p in pages.tolist()])
    for layer in range(spec.layers):
        transfer = stream.scatter(host, pages, pool, slots, spec, Layout.PAGE_FIRST, [layer])
        transfer.wait_layer(layer)
        loaded = pool_pages(pool, spec, slots)
        assert torch.equal(loaded[:, :, : layer + 1], expected[:, :, : layer + 1])
        assert not loaded[:, :, layer + 1 :].any()
    stream.synchronize()


def test_no_pages_is_a_no_op() -> None:
    spec = SpecPreset.ODD.spec(page_size=2)
    pool = random_buffer(spec, Layout.LAYER_FIRST, 2, seed=8)
    host = zeros(spec, Layout.LAYER_FIRST, 2)
    transfer = gather(pool, [], host, torch.empty(0, dtype=torch.int64), spec, Layout.LAYER_FIRST)
    assert transfer.done() and not host.any()


def _bad_calls(spec: LayoutSpec):  # type: ignore[no-untyped-def]
    t, lay = spec.page_size, Layout.PAGE_FIRST
    ok_slots = list(range(2 * t))
    return {
        "slot out of range": (
            [0, 1],
            list(range(POOL_PAGES * t - 1, POOL_PAGES * t + 2 * t - 1)),
            lay,
            None,
        ),
        "negative slot": ([0, 1], [-1, *range(1, 2 * t)], lay, None),
        "repeated slot": ([0, 1], [0, *range(0, 2 * t - 1)], lay, None),
        "repeated page": ([1, 1], ok_slots, lay, None),
        "page out of range": ([0, HOST_PAGES], ok_slots, lay, None),
        "slot count": ([0, 1], ok_slots[:-1], lay, None),
        "float slots": ([0, 1], torch.arange(2 * t, dtype=torch.float32), lay, None),
        "bool pages": (torch.tensor([True, False]), ok_slots, lay, None),
        "layer out of range": ([0, 1], ok_slots, lay, [0, spec.layers]),
        "repeated layer": ([0, 1], ok_slots, lay, [1, 1]),
        "host in another layout": ([0, 1], ok_slots, Layout.PAGE_FIRST_DIRECT, None),
        "raw layout": ([0, 1], ok_slots, Layout.RAW, None),
    }


@pytest.mark.parametrize("case", list(_bad_calls(SpecPreset.MHA.spec(page_size=2, layers=3))))
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_bad_input_changes_nothing(case: str, direction: str) -> None:
    spec = SpecPreset.MHA.spec(page_size=2, layers=3)
    pages, slots, layout, layers = _bad_calls(spec)[case]
    pool = random_buffer(spec, Layout.LAYER_FIRST, POOL_PAGES, seed=9)
    host = random_buffer(spec, Layout.PAGE_FIRST, HOST_PAGES, seed=10)
    if layout is Layout.PAGE_FIRST_DIRECT:  # same bytes, wrong shape for that layout
        host = host.view(buffer_shape(spec, Layout.PAGE_FIRST, HOST_PAGES))
    pool_before, host_before = pool.clone(), host.clone()
    with pytest.raises(LayoutError):
        if direction == "gather":
            gather(pool, slots, host, pages, spec, layout, layers=layers)
        else:
            scatter(host, pages, pool, slots, spec, layout, layers=layers)
    assert torch.equal(pool.view(torch.int16), pool_before.view(torch.int16))
    assert torch.equal(host.view(torch.int16), host_before.view(torch.int16))


def test_bad_buffers_and_streams() -> None:
    spec = SpecPreset.MHA.spec(page_size=2, layers=2)
    pool = zeros(spec, Layout.LAYER_FIRST, 2)
    host = zeros(spec, Layout.PAGE_FIRST, 2)
    with pytest.raises(LayoutError, match=r"torch\.Tensor"):
        gather("pool", [0, 1], host, [0], spec, Layout.PAGE_FIRST)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="dtype"):
        gather(pool.float(), [0, 1], host, [0], spec, Layout.PAGE_FIRST)
    with pytest.raises(LayoutError, match="device pool"):
        gather(host, [0, 1], host, [0], spec, Layout.PAGE_FIRST)  # a pool must be layer_first
    with pytest.raises(LayoutError, match="meta"):
        TransferStream("meta")
    assert not host.any()


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, HOST_PAGES),
    aligned=st.booleans(),
    layout=st.sampled_from(KV_LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_random_page_sets_round_trip(n: int, aligned: bool, layout: Layout, seed: int) -> None:
    spec = SpecPreset.ODD.spec(page_size=3)
    pool = random_buffer(spec, Layout.LAYER_FIRST, POOL_PAGES, seed=seed)
    host = zeros(spec, layout, HOST_PAGES)
    pages, slots = choose(spec, n, aligned, seed)
    gather(pool, slots, host, pages, spec, layout)
    fresh = zeros(spec, Layout.LAYER_FIRST, POOL_PAGES)
    scatter(host, pages.tolist(), fresh, slots.tolist(), spec, layout)
    assert torch.equal(pool_pages(fresh, spec, slots), pool_pages(pool, spec, slots))
