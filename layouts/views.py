"""Tensor views of KV buffers: checking a buffer against its spec, pages as views or bytes.

A page view shares memory with the buffer: writing into it (for example a backend's
``get_into`` into :func:`page_segments`) writes the buffer. :func:`host_on_device` is a pinned
host buffer as CUDA kernels address it, without a copy.
"""

from __future__ import annotations

import torch

from hicache.dtypes import Layout
from hicache.errors import LayoutError
from hicache.layouts.shapes import (
    Axis,
    axis_order,
    buffer_num_pages,
    buffer_shape,
    expanded_shape,
    page_shape,
)
from hicache.layouts.spec import LayoutSpec

__all__ = [
    "canonical_words",
    "check_buffer",
    "empty_buffer",
    "host_on_device",
    "page_segments",
    "page_tensor",
    "page_view",
    "read_page",
    "word_size",
    "word_view",
    "write_page",
]

_WORDS = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def check_buffer(buffer: object, spec: LayoutSpec, layout: Layout, what: str = "buffer") -> int:
    """Check that ``buffer`` is a contiguous ``layout`` tensor of ``spec``; its page count."""
    if not isinstance(buffer, torch.Tensor):
        raise LayoutError(f"{what} must be a torch.Tensor, got {type(buffer).__name__}")
    want = spec.dtype.to_torch()
    if buffer.dtype != want:
        raise LayoutError(f"{what} has dtype {buffer.dtype}; the spec says {want}")
    try:
        pages = buffer_num_pages(spec, layout, tuple(buffer.shape))
    except LayoutError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    if not buffer.is_contiguous():
        raise LayoutError(f"{what} must be contiguous")
    return pages


def empty_buffer(
    spec: LayoutSpec,
    layout: Layout,
    num_pages: int,
    device: torch.device | str = "cpu",
    pin_memory: bool = False,
) -> torch.Tensor:
    """An uninitialised ``layout`` buffer of ``num_pages`` pages; ``pin_memory`` for a host
    buffer that CUDA transfers use (they refuse pageable memory)."""
    shape = buffer_shape(spec, layout, num_pages)
    return torch.empty(shape, dtype=spec.dtype.to_torch(), device=device, pin_memory=pin_memory)


def word_size(spec: LayoutSpec, *tensors: torch.Tensor) -> int:
    """The widest copy unit that divides an item and every data address: up to 16 bytes on
    CUDA, 8 on the CPU.

    Copies move whole items, so copying them as wide words is exact and needs far fewer index
    computations than copying bytes or 2-byte elements. On CUDA a 16-byte word is a
    ``complex128``: the copy kernels only load and store it, so every bit pattern survives
    (the CUDA tests copy random bytes, NaN patterns included); it is the width at which
    strided copies reach the copy engine's speed.
    """
    size = 16 if tensors and all(t.device.type == "cuda" for t in tensors) else 8
    for nbytes in (spec.item_bytes, *(t.data_ptr() for t in tensors)):
        while nbytes % size:
            size //= 2
    return size


def word_view(buffer: torch.Tensor, spec: LayoutSpec, word: int) -> torch.Tensor:
    """``buffer`` (contiguous, items last) with each item as ``item_bytes // word`` words."""
    lead = buffer.shape[: buffer.dim() - len(spec.item_shape)]
    flat = buffer.view(*lead, spec.item_elems).view(torch.uint8)
    return flat.view(_WORDS[word])


def canonical_words(
    buffer: torch.Tensor, spec: LayoutSpec, layout: Layout, num_pages: int, word: int
) -> torch.Tensor:
    """A (P, C, L, T, words) view of a checked buffer in any layout: every layout indexed alike."""
    shape = expanded_shape(spec, layout, num_pages)[:4]
    words = word_view(buffer, spec, word).view(*shape, spec.item_bytes // word)
    order = axis_order(layout)
    return words.permute(*(order.index(axis) for axis in Axis), 4)


def page_tensor(buffer: torch.Tensor, spec: LayoutSpec, layout: Layout, page: int) -> torch.Tensor:
    """One page as a view of shape :func:`~hicache.layouts.shapes.page_shape` (stored order);
    contiguous in the page_first family, strided in ``layer_first``."""
    pages = check_buffer(buffer, spec, layout)
    if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < pages:
        raise LayoutError(f"page {page!r} out of range [0, {pages})")
    if layout is Layout.LAYER_FIRST:
        split = buffer.view(expanded_shape(spec, layout, pages))
        return split[:, :, page]
    return buffer[page]


def page_view(
    buffer: torch.Tensor, spec: LayoutSpec, layout: Layout, page: int
) -> list[torch.Tensor]:
    """A page as contiguous views in stored order: one for the page_first family, ``C * L``
    pieces of shape ``(T, *item)`` (component-major) for ``layer_first``."""
    view = page_tensor(buffer, spec, layout, page)
    if layout is Layout.LAYER_FIRST:
        return [piece for per_component in view for piece in per_component]
    return [view]


def page_segments(
    buffer: torch.Tensor, spec: LayoutSpec, layout: Layout, page: int
) -> list[memoryview]:
    """:func:`page_view` as flat byte memoryviews (CPU buffers): a backend's scatter-gather
    segments for ``put`` and ``get_into``, with no copy."""
    if buffer.device.type != "cpu":
        raise LayoutError(f"page segments need a CPU buffer, not {buffer.device}")
    return [
        piece.reshape(-1).view(torch.uint8).numpy().data
        for piece in page_view(buffer, spec, layout, page)
    ]


def _as_page(data: object, spec: LayoutSpec, layout: Layout) -> torch.Tensor:
    """``data`` as a page tensor: a tensor of the page shape and dtype, or flat page bytes."""
    shape = page_shape(spec, layout)
    if not isinstance(data, torch.Tensor):
        raise LayoutError(f"a page must be a torch.Tensor, got {type(data).__name__}")
    if data.dtype == torch.uint8 and tuple(data.shape) == (spec.page_bytes,):
        return data.view(spec.dtype.to_torch()).view(shape)
    if data.dtype != spec.dtype.to_torch():
        raise LayoutError(f"page has dtype {data.dtype}; the spec says {spec.dtype.label}")
    if tuple(data.shape) != shape:
        raise LayoutError(
            f"page has shape {list(data.shape)}; a {layout.label} page is {list(shape)}"
        )
    return data


def write_page(
    buffer: torch.Tensor, spec: LayoutSpec, layout: Layout, page: int, data: torch.Tensor
) -> None:
    """Copy one page (stored order, or its flat bytes) into the buffer; checked before writing."""
    target = page_tensor(buffer, spec, layout, page)
    source = _as_page(data, spec, layout).contiguous()
    word = word_size(spec, target, source)
    word_view(target, spec, word).copy_(word_view(source, spec, word))


def read_page(buffer: torch.Tensor, spec: LayoutSpec, layout: Layout, page: int) -> torch.Tensor:
    """A contiguous copy of one page in stored order."""
    return page_tensor(buffer, spec, layout, page).clone(memory_format=torch.contiguous_format)


class _PinnedHostMemory:
    """Pinned host memory presented to CUDA kernels through unified addressing (no copy)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor  # the alias holds this object, so the memory outlives the alias
        nbytes = tensor.numel() * tensor.element_size()
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "version": 2,
            "strides": None,
        }


def host_on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` as ``device``'s kernels read and write it: itself on its own device; a pinned
    CPU buffer seen from CUDA through unified addressing, without a copy (the alias keeps the
    buffer alive). Raises ``LayoutError`` for unpinned memory or another pair of devices."""
    if host.device == device:
        return host
    if device.type == "cuda" and host.device.type == "cpu":
        if not host.is_pinned():
            raise LayoutError("a host buffer copied to or from CUDA must be pinned memory")
        flat = torch.as_tensor(_PinnedHostMemory(host), device=device)
        return flat.view(host.dtype).view(host.shape)
    raise LayoutError(f"cannot copy between a {device} pool and a {host.device} host buffer")
