"""Page views: one contiguous buffer per page (page_first family), pieces (layer_first)."""

from __future__ import annotations

import pytest
import torch
from layout_kit import every_preset_and_layout, random_buffer, small

from hicache.errors import LayoutError
from hicache.layouts import (
    KV_LAYOUTS,
    Layout,
    SpecPreset,
    buffer_shape,
    check_buffer,
    convert,
    empty_buffer,
    page_segments,
    page_shape,
    page_view,
    read_page,
    storage_layout,
    write_page,
)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def inside(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    return start <= view.data_ptr() < end


@every_preset_and_layout
def test_page_view_shares_memory_in_stored_order(preset: SpecPreset, layout: Layout) -> None:
    spec, pages = small(preset), 3
    buffer = random_buffer(spec, layout, pages, seed=0)
    stored = convert(buffer, spec, layout, storage_layout(layout))
    for page in range(pages):
        pieces = page_view(buffer, spec, layout, page)
        if layout is Layout.LAYER_FIRST:
            assert len(pieces) == spec.num_components * spec.layers
            assert all(p.shape == (spec.page_size, *spec.item_shape) for p in pieces)
        else:
            assert len(pieces) == 1 and pieces[0].shape == page_shape(spec, layout)
        assert all(p.is_contiguous() and inside(p, buffer) for p in pieces)
        joined = torch.cat([as_bytes(p) for p in pieces])
        assert torch.equal(joined, as_bytes(stored[page]))
        assert torch.equal(as_bytes(read_page(buffer, spec, layout, page)), joined)


@pytest.mark.parametrize("layout", KV_LAYOUTS, ids=lambda x: x.label)
def test_page_segments_write_through(layout: Layout) -> None:
    """A backend's get_into writing the segments writes the page, and only that page."""
    spec = SpecPreset.MHA.spec(page_size=2, layers=2)
    buffer = torch.zeros(buffer_shape(spec, layout, 3), dtype=torch.bfloat16)
    source = random_buffer(spec, layout, 3, seed=5)
    wanted = as_bytes(read_page(source, spec, layout, 1)).numpy().tobytes()
    segments = page_segments(buffer, spec, layout, 1)
    assert sum(s.nbytes for s in segments) == spec.page_bytes
    offset = 0
    for segment in segments:
        segment[:] = wanted[offset : offset + segment.nbytes]
        offset += segment.nbytes
    assert torch.equal(
        as_bytes(read_page(buffer, spec, layout, 1)), as_bytes(read_page(source, spec, layout, 1))
    )
    assert not read_page(buffer, spec, layout, 0).view(torch.int16).any()
    assert not read_page(buffer, spec, layout, 2).view(torch.int16).any()


@every_preset_and_layout
def test_write_then_read_page(preset: SpecPreset, layout: Layout) -> None:
    spec = preset.spec(page_size=3, layers=2)
    buffer = torch.zeros(buffer_shape(spec, layout, 4), dtype=spec.dtype.to_torch())
    page = random_buffer(spec, Layout.PAGE_FIRST, 1, seed=9).view(-1)
    page = page.view(torch.uint8).view(spec.dtype.to_torch()).view(page_shape(spec, layout))
    write_page(buffer, spec, layout, 2, page)
    assert torch.equal(as_bytes(read_page(buffer, spec, layout, 2)), as_bytes(page))
    flat = as_bytes(page).flip(0).contiguous()  # flat page bytes are accepted too
    write_page(buffer, spec, layout, 0, flat)
    assert torch.equal(as_bytes(read_page(buffer, spec, layout, 0)), flat)
    assert not as_bytes(read_page(buffer, spec, layout, 1)).any()


@pytest.mark.parametrize("layout", KV_LAYOUTS, ids=lambda x: x.label)
def test_bad_pages_are_refused_and_the_buffer_is_unchanged(layout: Layout) -> None:
    spec = SpecPreset.MLA.spec(page_size=2, layers=2)
    buffer = torch.zeros(buffer_shape(spec, layout, 2), dtype=torch.bfloat16)
    good = torch.ones(page_shape(spec, layout), dtype=torch.bfloat16)
    bad_pages = [
        good.float(),  # dtype
        good[:, :1],  # shape
        torch.ones(spec.page_bytes + 1, dtype=torch.uint8),  # flat, wrong length
        good.tolist(),  # not a tensor
    ]
    for bad in bad_pages:
        with pytest.raises(LayoutError):
            write_page(buffer, spec, layout, 0, bad)  # type: ignore[arg-type]
    for index in (2, -1, True):
        with pytest.raises(LayoutError, match="page"):
            write_page(buffer, spec, layout, index, good)  # type: ignore[arg-type]
    assert not buffer.any()


def test_check_buffer() -> None:
    spec = SpecPreset.MHA.spec(page_size=2, layers=2)
    good = torch.zeros(buffer_shape(spec, Layout.PAGE_FIRST, 3), dtype=torch.bfloat16)
    assert check_buffer(good, spec, Layout.PAGE_FIRST) == 3
    with pytest.raises(LayoutError, match="dtype"):
        check_buffer(good.half(), spec, Layout.PAGE_FIRST)
    with pytest.raises(LayoutError, match="contiguous"):
        check_buffer(good.transpose(2, 3).contiguous().transpose(2, 3), spec, Layout.PAGE_FIRST)
    with pytest.raises(LayoutError, match=r"torch\.Tensor"):
        check_buffer(b"bytes", spec, Layout.PAGE_FIRST)
    with pytest.raises(LayoutError, match="not a page_first_direct buffer"):
        check_buffer(good[:, :, :1], spec, Layout.PAGE_FIRST_DIRECT)


@pytest.mark.parametrize("layout", KV_LAYOUTS, ids=lambda x: x.label)
def test_empty_buffer_fits_its_layout(layout: Layout) -> None:
    spec = SpecPreset.MHA_FP8.spec(page_size=2, layers=2)
    buffer = empty_buffer(spec, layout, 3)
    assert buffer.dtype == torch.float8_e4m3fn and check_buffer(buffer, spec, layout) == 3
