"""Conversion of whole KV buffers between layouts, on whatever device the buffer is on.

Each conversion is one strided copy: the source is viewed with its four axes permuted into the
target's order and copied into a contiguous target. Items move whole, as 8-byte (or narrower)
words, so a conversion is exact for every dtype, NaN payloads included.
"""

from __future__ import annotations

import torch

from hicache.dtypes import Layout
from hicache.errors import LayoutError, UnsupportedLayoutError
from hicache.layouts.shapes import KV_LAYOUTS, axis_order, buffer_shape, expanded_shape
from hicache.layouts.spec import LayoutSpec
from hicache.layouts.views import check_buffer, word_size, word_view

__all__ = ["conversions", "convert"]


def _permutation(src: Layout, dst: Layout) -> tuple[int, ...]:
    """Where each of ``dst``'s axes sits in ``src``: the argument of ``permute``."""
    src_order, dst_order = axis_order(src), axis_order(dst)
    return tuple(src_order.index(axis) for axis in dst_order)


# The (from, to) table; a pair that is not here is unsupported (RAW has no KV structure).
_CONVERSIONS: dict[tuple[Layout, Layout], tuple[int, ...]] = {
    (src, dst): _permutation(src, dst) for src in KV_LAYOUTS for dst in KV_LAYOUTS
}


def conversions() -> list[tuple[Layout, Layout]]:
    """Every supported (from, to) pair, identity pairs included."""
    return list(_CONVERSIONS)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


def convert(
    src: torch.Tensor,
    spec: LayoutSpec,
    from_layout: Layout,
    to_layout: Layout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``src`` (a ``from_layout`` buffer of ``spec``) in ``to_layout``: into ``out`` if given
    (same page count, not overlapping ``src``), else into a new tensor on ``src``'s device.

    Raises :class:`UnsupportedLayoutError` for a pair outside the table and
    :class:`LayoutError` for a buffer that does not match; nothing is written then.
    """
    perm = _CONVERSIONS.get((from_layout, to_layout))
    if perm is None:
        raise UnsupportedLayoutError(f"no conversion from {from_layout!r} to {to_layout!r}")
    pages = check_buffer(src, spec, from_layout, "source")
    if out is None:
        out = torch.empty(buffer_shape(spec, to_layout, pages), dtype=src.dtype, device=src.device)
    else:
        out_pages = check_buffer(out, spec, to_layout, "out")
        if out_pages != pages:
            raise LayoutError(f"out holds {out_pages} pages; the source holds {pages}")
        if _shares_memory(src, out):
            raise LayoutError("out overlaps the source; a conversion cannot run in place")
    word = word_size(spec, src, out)
    words = spec.item_bytes // word
    source = word_view(src, spec, word).view(*expanded_shape(spec, from_layout, pages)[:4], words)
    target = word_view(out, spec, word).view(*expanded_shape(spec, to_layout, pages)[:4], words)
    target.copy_(source.permute(*perm, 4))
    return out
