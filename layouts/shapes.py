"""Pure shape and offset arithmetic of the three KV layouts: no tensors, no I/O.

Every layout orders the same four axes — page ``P``, component ``C`` (K/V, or one MLA latent),
layer ``L``, token within the page ``T`` — followed by the item (``spec.item_shape``, e.g. H, D):

==================== ============================ ===========================================
layout               buffer shape                 one page, in memory and in storage
==================== ============================ ===========================================
``layer_first``      ``(C, L, P*T, *item)``       ``C*L`` pieces of ``T*item`` (one per
                                                  component and layer); stored concatenated in
                                                  (component, layer) order
``page_first``       ``(P, C, T, L, *item)``      contiguous: [component][token][layer][item]
``page_first_direct`` ``(P, C, L, T, *item)``     contiguous: [component][layer][token][item]
==================== ============================ ===========================================

``layer_first`` is the device pool's order (and SGLang's: K and V stacked on dim 0). In the
page_first family the component axis sits *inside* the page, so a page is one contiguous buffer,
one stored object per page; each component's part is SGLang's own page_first (or
page_first_direct) page of that component, K then V. A ``layer_first`` page stored as its pieces
in order has exactly the bytes of a ``page_first_direct`` page (:func:`storage_layout`).
All buffers are C-contiguous; offsets are in bytes from the buffer's start.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

from hicache.dtypes import Layout
from hicache.errors import LayoutError, UnsupportedLayoutError
from hicache.layouts.spec import LayoutSpec

__all__ = [
    "KV_LAYOUTS",
    "Axis",
    "ByteRange",
    "axis_order",
    "buffer_bytes",
    "buffer_num_pages",
    "buffer_shape",
    "element_strides",
    "expanded_shape",
    "item_offset",
    "page_ranges",
    "page_shape",
    "storage_layout",
]


class Axis(enum.IntEnum):
    """The four axes every layout orders; the values are the canonical order (P, C, L, T)."""

    PAGE = 0
    COMPONENT = 1
    LAYER = 2
    TOKEN = 3


_ORDERS: dict[Layout, tuple[Axis, ...]] = {
    Layout.LAYER_FIRST: (Axis.COMPONENT, Axis.LAYER, Axis.PAGE, Axis.TOKEN),
    Layout.PAGE_FIRST: (Axis.PAGE, Axis.COMPONENT, Axis.TOKEN, Axis.LAYER),
    Layout.PAGE_FIRST_DIRECT: (Axis.PAGE, Axis.COMPONENT, Axis.LAYER, Axis.TOKEN),
}

KV_LAYOUTS: tuple[Layout, ...] = tuple(_ORDERS)


class ByteRange(NamedTuple):
    offset: int
    nbytes: int


def axis_order(layout: Layout) -> tuple[Axis, ...]:
    """The order of (page, component, layer, token) in ``layout``, outermost first."""
    try:
        return _ORDERS[layout]
    except (KeyError, TypeError):
        raise UnsupportedLayoutError(f"{layout!r} is not a KV layout") from None


def _axis_sizes(spec: LayoutSpec, num_pages: int) -> tuple[int, int, int, int]:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
        raise LayoutError(f"num_pages must be an int >= 0, got {num_pages!r}")
    return (num_pages, spec.num_components, spec.layers, spec.page_size)


def expanded_shape(spec: LayoutSpec, layout: Layout, num_pages: int) -> tuple[int, ...]:
    """The buffer's shape with page and token as separate axes: four axes, then the item."""
    sizes = _axis_sizes(spec, num_pages)
    return tuple(sizes[a] for a in axis_order(layout)) + spec.item_shape


def buffer_shape(spec: LayoutSpec, layout: Layout, num_pages: int) -> tuple[int, ...]:
    """The shape of a host buffer of ``num_pages`` pages (``layer_first`` merges P and T)."""
    shape = expanded_shape(spec, layout, num_pages)
    if layout is Layout.LAYER_FIRST:
        return (shape[0], shape[1], shape[2] * shape[3], *shape[4:])
    return shape


def page_shape(spec: LayoutSpec, layout: Layout) -> tuple[int, ...]:
    """The shape of one page in its stored byte order (see the module table)."""
    order = axis_order(storage_layout(layout))
    sizes = _axis_sizes(spec, 1)
    return tuple(sizes[a] for a in order if a is not Axis.PAGE) + spec.item_shape


def buffer_num_pages(spec: LayoutSpec, layout: Layout, shape: tuple[int, ...]) -> int:
    """How many pages a buffer of ``shape`` holds; LayoutError when no page count fits."""
    one = buffer_shape(spec, layout, 1)
    page_dim = 2 if layout is Layout.LAYER_FIRST else 0
    shape = tuple(shape)
    if len(shape) == len(one) and shape[page_dim] % one[page_dim] == 0:
        pages = shape[page_dim] // one[page_dim]
        if shape == buffer_shape(spec, layout, pages):
            return pages
    raise LayoutError(
        f"shape {list(shape)} is not a {layout.label} buffer of this spec "
        f"(one page is {list(one)}, pages along dim {page_dim})"
    )


def element_strides(spec: LayoutSpec, layout: Layout, num_pages: int) -> tuple[int, ...]:
    """C-contiguous strides, in elements, of :func:`buffer_shape`."""
    return _contiguous_strides(buffer_shape(spec, layout, num_pages))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)  # as torch does for empty dims
    return tuple(strides)


def _check_index(name: str, value: int, size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise LayoutError(f"{name} {value!r} out of range [0, {size})")


def item_offset(
    spec: LayoutSpec, layout: Layout, num_pages: int, component: int, layer: int, slot: int
) -> int:
    """Byte offset of the item of (``component``, ``layer``, token ``slot``) in the buffer.

    ``slot`` is ``page * page_size + token``, as in the device pool.
    """
    sizes = _axis_sizes(spec, num_pages)
    _check_index("component", component, sizes[Axis.COMPONENT])
    _check_index("layer", layer, sizes[Axis.LAYER])
    _check_index("slot", slot, num_pages * spec.page_size)
    index = (slot // spec.page_size, component, layer, slot % spec.page_size)
    order = axis_order(layout)
    strides = _contiguous_strides(expanded_shape(spec, layout, num_pages))
    elements = sum(index[axis] * strides[pos] for pos, axis in enumerate(order))
    return elements * spec.dtype.itemsize


def page_ranges(
    spec: LayoutSpec, layout: Layout, num_pages: int, page: int
) -> tuple[ByteRange, ...]:
    """The byte ranges of one page, in stored order: one range in the page_first family,
    ``C * L`` ranges (component-major) in ``layer_first``. Zero-copy backends read and write
    these directly."""
    _check_index("page", page, num_pages)
    if layout is not Layout.LAYER_FIRST:
        axis_order(layout)  # rejects RAW and non-layouts
        return (ByteRange(page * spec.page_bytes, spec.page_bytes),)
    piece = spec.page_size * spec.item_bytes
    slot = page * spec.page_size
    return tuple(
        ByteRange(item_offset(spec, layout, num_pages, c, layer, slot), piece)
        for c in range(spec.num_components)
        for layer in range(spec.layers)
    )


def storage_layout(layout: Layout) -> Layout:
    """The layout whose page byte order a page of ``layout`` has once stored.

    ``layer_first`` pages are stored as their pieces in (component, layer) order, which is the
    ``page_first_direct`` page order, so the two host layouts can share stored pages.
    """
    axis_order(layout)
    return Layout.PAGE_FIRST_DIRECT if layout is Layout.LAYER_FIRST else layout


def buffer_bytes(spec: LayoutSpec, num_pages: int) -> int:
    """Bytes of a buffer of ``num_pages`` pages (the same in every layout)."""
    return math.prod(_axis_sizes(spec, num_pages)) * spec.item_bytes
