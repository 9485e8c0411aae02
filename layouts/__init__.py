"""KV memory layouts: shapes, offsets, page views, conversions and device<->host copies.

``import hicache.layouts``. The byte order of every layout, and so of every stored page, is in
:mod:`hicache.layouts.shapes`. The tensor parts (views, conversion, transfers) are imported on
first use, so modules that only need shapes do not import torch. ``Layout`` is defined beside
``DType`` in :mod:`hicache.dtypes` (keys and the codec use it without this package) and
re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.dtypes import Layout
from hicache.layouts.shapes import (
    KV_LAYOUTS,
    Axis,
    ByteRange,
    axis_order,
    buffer_bytes,
    buffer_num_pages,
    buffer_shape,
    element_strides,
    expanded_shape,
    item_offset,
    page_ranges,
    page_shape,
    storage_layout,
)
from hicache.layouts.spec import KV_COMPONENTS, LATENT_COMPONENTS, LayoutSpec, SpecPreset
from hicache.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from hicache.layouts.conversion import conversions, convert
    from hicache.layouts.transfer import (
        LayerEvent,
        LayerTransfer,
        TransferStream,
        gather,
        scatter,
    )
    from hicache.layouts.views import (
        check_buffer,
        empty_buffer,
        page_segments,
        page_tensor,
        page_view,
        read_page,
        write_page,
    )

_LAZY = {
    "conversions": ".conversion",
    "convert": ".conversion",
    "LayerEvent": ".transfer",
    "LayerTransfer": ".transfer",
    "TransferStream": ".transfer",
    "gather": ".transfer",
    "scatter": ".transfer",
    "check_buffer": ".views",
    "empty_buffer": ".views",
    "page_segments": ".views",
    "page_tensor": ".views",
    "page_view": ".views",
    "read_page": ".views",
    "write_page": ".views",
}

__all__ = [
    "KV_COMPONENTS",
    "KV_LAYOUTS",
    "LATENT_COMPONENTS",
    "Axis",
    "ByteRange",
    "LayerEvent",
    "LayerTransfer",
    "Layout",
    "LayoutSpec",
    "SpecPreset",
    "TransferStream",
    "axis_order",
    "buffer_bytes",
    "buffer_num_pages",
    "buffer_shape",
    "check_buffer",
    "conversions",
    "convert",
    "element_strides",
    "empty_buffer",
    "expanded_shape",
    "gather",
    "item_offset",
    "page_ranges",
    "page_segments",
    "page_shape",
    "page_tensor",
    "page_view",
    "read_page",
    "scatter",
    "storage_layout",
    "write_page",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
