"""Checked arguments of a device<->host transfer, turned into the copies that run it.

Two plans, chosen by where the copy runs:

- :class:`RowPlan` (CUDA, and any pool whose slots are not whole pages): both buffers as 2-D
  tables of rows, a row being one item, or a page's run of items of one layer where both sides
  hold it contiguously. A layer is one row gather plus one row scatter: two kernels whatever the
  number of pages, which is what a GPU wants.
- :class:`PagePlan` (CPU, page-aligned slots): one strided slice copy per page (all layers at
  once) or per (page, layer). On the CPU, torch's index kernels copy element by element, several
  times slower than these slice copies, which move each item's bytes with one memcpy-like loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hicache.dtypes import Layout
from hicache.errors import LayoutError
from hicache.layouts.shapes import Axis, axis_order, buffer_num_pages, expanded_shape
from hicache.layouts.spec import LayoutSpec
from hicache.layouts.views import (
    canonical_words,
    check_buffer,
    host_on_device,
    word_size,
    word_view,
)

__all__ = ["CopyPlan", "IndexLike", "PagePlan", "RowPlan", "make_plan"]

IndexLike = torch.Tensor | Sequence[int]


class CopyPlan(Protocol):
    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def device(self) -> torch.device: ...

    def to_device(self) -> CopyPlan: ...

    def copy_layer(self, layer: int, to_host: bool) -> None: ...

    def copy_all(self, to_host: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class RowPlan:
    device_rows: torch.Tensor  # the pool as (rows, words per row)
    host_rows: torch.Tensor  # the host buffer likewise, on the pool's device (maybe an alias)
    device_base: torch.Tensor  # the pool row of each copied row, at layer 0
    host_base: torch.Tensor  # the host row of the same rows, at layer 0
    device_layer_stride: int
    host_layer_stride: int
    layers: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.device_rows.device

    def to_device(self) -> RowPlan:
        return dataclasses.replace(
            self,
            device_base=self.device_base.to(self.device, non_blocking=True),
            host_base=self.host_base.to(self.device, non_blocking=True),
        )

    def copy_layer(self, layer: int, to_host: bool) -> None:
        device_index = self.device_base + layer * self.device_layer_stride
        host_index = self.host_base + layer * self.host_layer_stride
        if to_host:
            rows = self.device_rows.index_select(0, device_index)
            self.host_rows.index_copy_(0, host_index, rows)
        else:
            rows = self.host_rows.index_select(0, host_index)
            self.device_rows.index_copy_(0, device_index, rows)

    def copy_all(self, to_host: bool) -> None:
        for layer in self.layers:
            self.copy_layer(layer, to_host)


@dataclass(frozen=True, slots=True)
class PagePlan:
    device_pages: torch.Tensor  # the pool as (C, L, device pages, T, words)
    host_pages: torch.Tensor  # the host buffer as (P, C, L, T, words), any layout
    pairs: tuple[tuple[int, int], ...]  # (host page, device page)
    layers: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.device_pages.device

    def to_device(self) -> PagePlan:
        return self

    def copy_layer(self, layer: int, to_host: bool) -> None:
        for host_page, device_page in self.pairs:
            host = self.host_pages[host_page, :, layer]
            pool = self.device_pages[:, layer, device_page]
            if to_host:
                host.copy_(pool)
            else:
                pool.copy_(host)

    def copy_all(self, to_host: bool) -> None:
        if self.layers != tuple(range(self.device_pages.shape[1])):
            for layer in self.layers:
                self.copy_layer(layer, to_host)
            return
        page_bytes = self.host_pages[0].numel() * self.host_pages.element_size()
        if len(self.pairs) > 4 and page_bytes <= _SMALL_PAGE_BYTES:
            self._copy_gathered(to_host)
            return
        for host_page, device_page in self.pairs:
            host = self.host_pages[host_page]
            pool = self.device_pages[:, :, device_page]
            if to_host:
                host.copy_(pool)
            else:
                pool.copy_(host)

    def _copy_gathered(self, to_host: bool) -> None:
        """Small pages: one gather and one scatter for all, instead of a call per page (each
        copy call costs microseconds; the temporary copy is cheap at this size)."""
        host_index = torch.tensor([h for h, _ in self.pairs], dtype=torch.int64)
        device_index = torch.tensor([d for _, d in self.pairs], dtype=torch.int64)
        if to_host:
            self.host_pages[host_index] = self.device_pages[:, :, device_index].movedim(2, 0)
        else:
            self.device_pages[:, :, device_index] = self.host_pages[host_index].movedim(0, 2)


# Below this a page set is copied with one gather/scatter; above, page by page (no temporary).
_SMALL_PAGE_BYTES = 64 << 10


def _indices(values: IndexLike, size: int, what: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor of distinct indices in ``[0, size)``."""
    index = values if isinstance(values, torch.Tensor) else torch.as_tensor(list(values))
    if index.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise LayoutError(f"{what} indices must be integers, got {index.dtype}")
    index = index.detach().to("cpu", torch.int64).reshape(-1)
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= size:
        raise LayoutError(f"{what} index {low if low < 0 else high} out of range [0, {size})")
    if torch.unique(index).numel() != index.numel():
        raise LayoutError(f"repeated {what} index: each may appear once")
    return index


def _layers(layers: Sequence[int] | None, count: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(count))
    chosen = tuple(layers)
    for layer in chosen:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < count:
            raise LayoutError(f"layer {layer!r} out of range [0, {count})")
    if len(set(chosen)) != len(chosen):
        raise LayoutError(f"repeated layer in {chosen}")
    return chosen


def _axis_strides(spec: LayoutSpec, layout: Layout, num_pages: int) -> list[int]:
    """Item strides of the four axes, indexed by :class:`Axis`."""
    shape = expanded_shape(spec, layout, num_pages)[:4]
    strides = [1, 1, 1, 1]
    for pos in range(2, -1, -1):
        strides[pos] = strides[pos + 1] * shape[pos + 1]
    order = axis_order(layout)
    return [strides[order.index(axis)] for axis in Axis]


def _whole_pages(spec: LayoutSpec, slots: torch.Tensor) -> bool:
    """Whether each page's slots are one device page, in order."""
    aligned = bool((slots[:, 0] % spec.page_size == 0).all())
    return aligned and bool((slots.diff(dim=1) == 1).all())


@dataclass(frozen=True, slots=True)
class _Checked:
    """Every argument of a transfer, checked."""

    device_kv: torch.Tensor
    host: torch.Tensor
    host_view: torch.Tensor  # ``host`` as the pool's device addresses it
    spec: LayoutSpec
    layout: Layout
    pages: torch.Tensor  # (n,) host pages
    slots: torch.Tensor  # (n, page_size) device slots
    layers: tuple[int, ...]

    @property
    def word(self) -> int:
        return word_size(self.spec, self.device_kv, self.host_view)

    def pool_pages(self) -> int:
        return self.device_kv.shape[2] // self.spec.page_size

    def host_pages(self) -> int:
        return buffer_num_pages(self.spec, self.layout, tuple(self.host.shape))


def _row_plan(c: _Checked) -> RowPlan:
    spec = c.spec
    token_innermost = axis_order(c.layout)[-1] is Axis.TOKEN
    run = spec.page_size if token_innermost and _whole_pages(spec, c.slots) else 1
    hs = _axis_strides(spec, c.layout, c.host_pages())
    ds = _axis_strides(spec, Layout.LAYER_FIRST, c.pool_pages())
    component = torch.arange(spec.num_components)[None, :, None]
    token = torch.arange(0, spec.page_size, run)[None, None, :]
    host_base = c.pages[:, None, None] * hs[Axis.PAGE] + component * hs[Axis.COMPONENT]
    host_base = host_base + token * hs[Axis.TOKEN]
    device_base = c.slots[:, None, ::run] + component * ds[Axis.COMPONENT]
    row_words = run * spec.item_bytes // c.word
    return RowPlan(
        word_view(c.device_kv, spec, c.word).view(-1, row_words),
        word_view(c.host_view, spec, c.word).view(-1, row_words),
        device_base.reshape(-1) // run,
        host_base.reshape(-1) // run,
        ds[Axis.LAYER] // run,
        hs[Axis.LAYER] // run,
        c.layers,
    )


def _page_plan(c: _Checked) -> PagePlan:
    spec, word = c.spec, c.word
    shape = expanded_shape(spec, Layout.LAYER_FIRST, c.pool_pages())[:4]
    pool = word_view(c.device_kv, spec, word).view(*shape, spec.item_bytes // word)
    host = canonical_words(c.host, spec, c.layout, c.host_pages(), word)
    pool_pages = (c.slots[:, 0] // spec.page_size).tolist()
    return PagePlan(pool, host, tuple(zip(c.pages.tolist(), pool_pages)), c.layers)


def make_plan(
    device_kv: torch.Tensor,
    slots: IndexLike,
    host: torch.Tensor,
    pages: IndexLike,
    spec: LayoutSpec,
    layout: Layout,
    layers: Sequence[int] | None,
) -> CopyPlan:
    """Check every argument (nothing is copied before this returns) and plan the copies."""
    device_pages = check_buffer(device_kv, spec, Layout.LAYER_FIRST, "device pool")
    host_pages = check_buffer(host, spec, layout, "host buffer")
    host_view = host_on_device(host, device_kv.device)
    page_index = _indices(pages, host_pages, "host page")
    slot_index = _indices(slots, device_pages * spec.page_size, "device slot")
    if slot_index.numel() != page_index.numel() * spec.page_size:
        raise LayoutError(
            f"{slot_index.numel()} device slots for {page_index.numel()} host pages; "
            f"need page_size ({spec.page_size}) slots per page"
        )
    checked = _Checked(
        device_kv,
        host,
        host_view,
        spec,
        layout,
        page_index,
        slot_index.view(-1, spec.page_size),
        _layers(layers, spec.layers),
    )
    if device_kv.device.type == "cpu" and _whole_pages(spec, checked.slots):
        return _page_plan(checked)
    return _row_plan(checked)
