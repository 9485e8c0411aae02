"""LayoutSpec, presets, and the pure shape/offset functions, checked against explicit indexing."""

from __future__ import annotations

import random

import pytest
import torch
from layout_kit import PRESETS, every_preset_and_layout, random_buffer, small

from hicache.dtypes import DType
from hicache.errors import LayoutError, UnsupportedLayoutError
from hicache.layouts import (
    Layout,
    LayoutSpec,
    SpecPreset,
    buffer_bytes,
    buffer_num_pages,
    buffer_shape,
    convert,
    element_strides,
    expanded_shape,
    item_offset,
    page_ranges,
    page_shape,
    storage_layout,
)


def item_at(buffer: torch.Tensor, spec: LayoutSpec, layout: Layout, c: int, layer: int, slot: int):  # type: ignore[no-untyped-def]
    """The item, by indexing each layout's documented shape directly."""
    page, token = divmod(slot, spec.page_size)
    if layout is Layout.LAYER_FIRST:
        return buffer[c, layer, slot]
    if layout is Layout.PAGE_FIRST:
        return buffer[page, c, token, layer]
    return buffer[page, c, layer, token]


# ----- the spec ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": 0},
        {"layers": True},
        {"page_size": -1},
        {"item_shape": ()},
        {"item_shape": [8, 128]},
        {"item_shape": (8, 0)},
        {"dtype": "bfloat16"},
        {"components": ()},
        {"components": ("k", "k")},
    ],
)
def test_bad_spec_is_a_layout_error(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"layers": 2, "page_size": 4, "item_shape": (8, 128)}
    fields.update(kwargs)
    with pytest.raises(LayoutError):
        LayoutSpec(**fields)  # type: ignore[arg-type]


def test_mha_and_mla_sizes() -> None:
    mha = LayoutSpec.mha(layers=32, heads=8, head_dim=128, page_size=64)
    assert mha.components == ("k", "v")
    assert mha.item_bytes == 8 * 128 * 2
    assert mha.page_bytes == 2 * 32 * 64 * 8 * 128 * 2
    mla = LayoutSpec.mla(layers=61, dim=576, page_size=64)
    assert (mla.num_components, mla.item_shape) == (1, (1, 576))
    assert mla.page_bytes == 61 * 64 * 576 * 2
    assert mha.component_index("v") == 1
    with pytest.raises(LayoutError):
        mha.component_index("latent")


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_build_and_override_layers(preset: SpecPreset) -> None:
    spec = preset.spec(page_size=16)
    assert spec.page_size == 16 and spec.layers >= 3
    assert preset.spec(page_size=16, layers=2).layers == 2


# ----- shapes -----------------------------------------------------------------------------------
def test_documented_shapes() -> None:
    spec = LayoutSpec.mha(layers=3, heads=2, head_dim=5, page_size=4)
    assert buffer_shape(spec, Layout.LAYER_FIRST, 6) == (2, 3, 24, 2, 5)
    assert buffer_shape(spec, Layout.PAGE_FIRST, 6) == (6, 2, 4, 3, 2, 5)
    assert buffer_shape(spec, Layout.PAGE_FIRST_DIRECT, 6) == (6, 2, 3, 4, 2, 5)
    assert expanded_shape(spec, Layout.LAYER_FIRST, 6) == (2, 3, 6, 4, 2, 5)
    assert page_shape(spec, Layout.PAGE_FIRST) == (2, 4, 3, 2, 5)
    assert page_shape(spec, Layout.PAGE_FIRST_DIRECT) == (2, 3, 4, 2, 5)
    assert page_shape(spec, Layout.LAYER_FIRST) == page_shape(spec, Layout.PAGE_FIRST_DIRECT)
    assert buffer_bytes(spec, 6) == 6 * spec.page_bytes


@every_preset_and_layout
def test_num_pages_inverts_shape(preset: SpecPreset, layout: Layout) -> None:
    spec = small(preset)
    for pages in (0, 1, 7):
        shape = buffer_shape(spec, layout, pages)
        assert buffer_num_pages(spec, layout, shape) == pages
        assert element_strides(spec, layout, pages) == torch.empty(shape).stride()
    bad = list(buffer_shape(spec, layout, 2))
    bad[-1] += 1
    for shape in (tuple(bad), buffer_shape(spec, layout, 2)[:-1], (1,)):
        with pytest.raises(LayoutError):
            buffer_num_pages(spec, layout, shape)


def test_layer_first_slots_must_be_whole_pages() -> None:
    spec = small(SpecPreset.MHA)
    shape = list(buffer_shape(spec, Layout.LAYER_FIRST, 2))
    shape[2] += 1
    with pytest.raises(LayoutError, match="layer_first"):
        buffer_num_pages(spec, Layout.LAYER_FIRST, tuple(shape))


# ----- offsets ----------------------------------------------------------------------------------
@every_preset_and_layout
def test_item_offset_points_at_the_item(preset: SpecPreset, layout: Layout) -> None:
    spec, pages = small(preset), 3
    buffer = random_buffer(spec, layout, pages, seed=0)
    flat = buffer.view(-1).view(torch.uint8)
    rng = random.Random(4)
    for _ in range(20):
        c = rng.randrange(spec.num_components)
        layer = rng.randrange(spec.layers)
        slot = rng.randrange(pages * spec.page_size)
        offset = item_offset(spec, layout, pages, c, layer, slot)
        want = item_at(buffer, spec, layout, c, layer, slot).contiguous().view(-1)
        assert torch.equal(flat[offset : offset + spec.item_bytes], want.view(torch.uint8))


@pytest.mark.parametrize(
    "args", [(2, 0, 0), (0, 3, 0), (0, 0, 12), (0, 0, -1), (0, 0, True)], ids=str
)
def test_item_offset_out_of_range(args: tuple[int, int, int]) -> None:
    spec = small(SpecPreset.MHA)
    with pytest.raises(LayoutError):
        item_offset(spec, Layout.PAGE_FIRST, 3, *args)


@every_preset_and_layout
def test_page_ranges_hold_the_stored_page(preset: SpecPreset, layout: Layout) -> None:
    """Joined in order, a page's ranges are the page_first(_direct) page: the stored format."""
    spec, pages = small(preset), 4
    buffer = random_buffer(spec, layout, pages, seed=1)
    flat = buffer.view(-1).view(torch.uint8)
    stored_as = storage_layout(layout)
    stored = convert(buffer, spec, layout, stored_as).view(pages, -1).view(torch.uint8)
    for page in range(pages):
        ranges = page_ranges(spec, layout, pages, page)
        pieces = 1 if layout is not Layout.LAYER_FIRST else spec.num_components * spec.layers
        assert len(ranges) == pieces
        assert sum(r.nbytes for r in ranges) == spec.page_bytes
        joined = torch.cat([flat[r.offset : r.offset + r.nbytes] for r in ranges])
        assert torch.equal(joined, stored[page])
    with pytest.raises(LayoutError):
        page_ranges(spec, layout, pages, pages)


def test_storage_layout() -> None:
    assert storage_layout(Layout.LAYER_FIRST) is Layout.PAGE_FIRST_DIRECT
    assert storage_layout(Layout.PAGE_FIRST) is Layout.PAGE_FIRST
    assert storage_layout(Layout.PAGE_FIRST_DIRECT) is Layout.PAGE_FIRST_DIRECT


@pytest.mark.parametrize("layout", [Layout.RAW, "page_first", None], ids=str)
def test_raw_and_non_layouts_are_unsupported(layout: object) -> None:
    spec = small(SpecPreset.MLA)
    for call in (
        lambda: buffer_shape(spec, layout, 1),  # type: ignore[arg-type]
        lambda: page_shape(spec, layout),  # type: ignore[arg-type]
        lambda: page_ranges(spec, layout, 1, 0),  # type: ignore[arg-type]
        lambda: storage_layout(layout),  # type: ignore[arg-type]
    ):
        with pytest.raises(UnsupportedLayoutError):
            call()


def test_unsupported_is_a_layout_error_and_a_value_error() -> None:
    assert issubclass(UnsupportedLayoutError, LayoutError)
    assert issubclass(LayoutError, ValueError)
    assert DType.BFLOAT16.itemsize == 2
