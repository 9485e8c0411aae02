"""convert(): every pair and every preset, against an independent reference; bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_kit import PRESETS, small

from hicache.dtypes import DType
from hicache.errors import LayoutError, UnsupportedLayoutError
from hicache.layouts import (
    KV_LAYOUTS,
    Layout,
    LayoutSpec,
    SpecPreset,
    buffer_shape,
    conversions,
    convert,
)

ROUTES = conversions()


def route_id(route: tuple[Layout, Layout]) -> str:
    return f"{route[0].label}-{route[1].label}"


def canonical(spec: LayoutSpec, pages: int, seed: int) -> torch.Tensor:
    """Random bytes (NaN patterns included) as a (P, C, L, T, *item) tensor."""
    raw = torch.empty(pages * spec.page_bytes, dtype=torch.uint8)
    raw.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    sizes = (pages, spec.num_components, spec.layers, spec.page_size)
    return raw.view(spec.dtype.to_torch()).view(*sizes, *spec.item_shape)


def laid_out(x: torch.Tensor, spec: LayoutSpec, layout: Layout) -> torch.Tensor:
    """The documented layouts, written out by hand from the canonical tensor."""
    if layout is Layout.LAYER_FIRST:  # (C, L, P*T, *item)
        y = x.permute(1, 2, 0, 3, *range(4, x.dim())).contiguous()
        return y.view(y.shape[0], y.shape[1], -1, *spec.item_shape)
    if layout is Layout.PAGE_FIRST:  # (P, C, T, L, *item)
        return x.permute(0, 1, 3, 2, *range(4, x.dim())).contiguous()
    return x.contiguous()  # page_first_direct: (P, C, L, T, *item)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)
    )


def test_the_table_has_every_kv_pair_and_nothing_else() -> None:
    assert sorted(ROUTES, key=str) == sorted(
        ((a, b) for a in KV_LAYOUTS for b in KV_LAYOUTS), key=str
    )
    assert all(Layout.RAW not in route for route in ROUTES)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("route", ROUTES, ids=route_id)
def test_convert_matches_reference_and_round_trips(
    preset: SpecPreset, route: tuple[Layout, Layout]
) -> None:
    spec = small(preset)
    for pages, seed in ((1, 1), (5, 2)):
        x = canonical(spec, pages, seed)
        src, want = laid_out(x, spec, route[0]), laid_out(x, spec, route[1])
        before = src.clone()
        got = convert(src, spec, *route)
        assert same_bytes(got, want)
        assert same_bytes(src, before)  # the source is only read
        assert same_bytes(convert(got, spec, route[1], route[0]), src)


@pytest.mark.parametrize("route", ROUTES, ids=route_id)
def test_convert_into_out(route: tuple[Layout, Layout]) -> None:
    spec = SpecPreset.ODD.spec(page_size=3)
    x = canonical(spec, 4, seed=3)
    out = torch.zeros(buffer_shape(spec, route[1], 4), dtype=torch.float16)
    assert convert(laid_out(x, spec, route[0]), spec, *route, out=out) is out
    assert same_bytes(out, laid_out(x, spec, route[1]))


def test_zero_pages() -> None:
    spec = SpecPreset.MLA.spec(page_size=2, layers=2)
    empty = torch.empty(buffer_shape(spec, Layout.PAGE_FIRST, 0), dtype=torch.bfloat16)
    assert convert(empty, spec, Layout.PAGE_FIRST, Layout.LAYER_FIRST).shape == (1, 2, 0, 1, 576)


@pytest.mark.parametrize(
    "route",
    [(Layout.RAW, Layout.PAGE_FIRST), (Layout.LAYER_FIRST, Layout.RAW), ("page_first", Layout.RAW)],
    ids=str,
)
def test_unsupported_pairs(route: tuple[Layout, Layout]) -> None:
    spec = SpecPreset.MHA.spec(page_size=2, layers=1)
    src = torch.zeros(buffer_shape(spec, Layout.PAGE_FIRST, 1), dtype=torch.bfloat16)
    with pytest.raises(UnsupportedLayoutError):
        convert(src, spec, *route)


def _bad_sources(spec: LayoutSpec) -> list[object]:
    good = torch.zeros(buffer_shape(spec, Layout.PAGE_FIRST, 2), dtype=torch.bfloat16)
    return [
        good.float(),  # wrong dtype
        good[:, :, :1],  # wrong shape
        good.transpose(2, 3).contiguous().transpose(2, 3),  # right shape, not contiguous
        "not a tensor",
    ]


@pytest.mark.parametrize("which", range(4))
def test_bad_source_is_refused_and_out_untouched(which: int) -> None:
    spec = SpecPreset.MHA.spec(page_size=2, layers=2)
    src = _bad_sources(spec)[which]
    out = torch.full(buffer_shape(spec, Layout.LAYER_FIRST, 2), 7.0, dtype=torch.bfloat16)
    with pytest.raises(LayoutError):
        convert(src, spec, Layout.PAGE_FIRST, Layout.LAYER_FIRST, out=out)  # type: ignore[arg-type]
    assert bool((out == 7).all())


def test_bad_out_is_refused_and_untouched() -> None:
    spec = SpecPreset.MHA.spec(page_size=2, layers=2)
    src = torch.ones(buffer_shape(spec, Layout.PAGE_FIRST, 2), dtype=torch.bfloat16)
    three = torch.zeros(buffer_shape(spec, Layout.LAYER_FIRST, 3), dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="pages"):
        convert(src, spec, Layout.PAGE_FIRST, Layout.LAYER_FIRST, out=three)
    assert not three.any()
    with pytest.raises(LayoutError, match="overlaps"):
        convert(src, spec, Layout.PAGE_FIRST, Layout.PAGE_FIRST, out=src)
    flat = torch.zeros(2 * src.numel(), dtype=torch.bfloat16)
    half = flat[: src.numel()].view(src.shape)
    with pytest.raises(LayoutError, match="overlaps"):
        convert(half, spec, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, out=half)
    assert not flat.any()


_DTYPES = [DType.UINT8, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.INT64]


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    page_size=st.integers(1, 4),
    item_shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(_DTYPES),
    components=st.integers(1, 3),
    pages=st.integers(0, 4),
    route=st.sampled_from(ROUTES),
    seed=st.integers(0, 2**16),
)
def test_any_spec_round_trips(
    layers: int,
    page_size: int,
    item_shape: tuple[int, ...],
    dtype: DType,
    components: int,
    pages: int,
    route: tuple[Layout, Layout],
    seed: int,
) -> None:
    names = tuple(f"c{i}" for i in range(components))
    spec = LayoutSpec(layers, page_size, item_shape, dtype, names)
    x = canonical(spec, pages, seed)
    got = convert(laid_out(x, spec, route[0]), spec, *route)
    assert same_bytes(got, laid_out(x, spec, route[1]))
    assert same_bytes(convert(got, spec, route[1], route[0]), laid_out(x, spec, route[0]))
