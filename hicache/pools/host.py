"""Host pools: one host tensor per pool, pinned when CUDA is there, in a chosen KV layout.

Host memory is counted in pages (one page is one stored object). Pages are allocated all or
nothing, freed once, and *protected* while something reads them outside the pool's control
(a write to storage in flight): a protected page cannot be freed. :meth:`HostPool.backup` and
:meth:`HostPool.load` copy pages to and from a :class:`~hicache.pools.device.DevicePool` with the
layouts' gather/scatter and return their per-layer completion events. A pool that
``shares_slots_with`` another uses that pool's page indices: pages are allocated and freed
through the owner, which refuses to free a page any of its sidecars still protects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from hicache.errors import ConfigError, InvalidArgumentError, UnsupportedLayoutError
from hicache.layouts import (
    LayerTransfer,
    Layout,
    TransferStream,
    buffer_shape,
    gather,
    page_segments,
    read_page,
    scatter,
    write_page,
)
from hicache.pools._index import IndexLike, check_indices
from hicache.pools.device import DevicePool
from hicache.pools.pool_base import PoolBase, build_pool_group
from hicache.pools.pool_spec import ModelPools, PoolSpec

__all__ = ["HostPool", "host_pools"]

logger = logging.getLogger(__name__)


def _resolve_pin(pin_memory: bool | None) -> bool:
    if pin_memory is None:
        return torch.cuda.is_available()
    if pin_memory and not torch.cuda.is_available():
        raise ConfigError("pinned host memory needs CUDA, which is not available")
    return bool(pin_memory)


class HostPool(PoolBase):
    """``num_pages`` host pages of one pool in ``layout`` (pinned when ``pin_memory``; by
    default when CUDA is available). ``owner``: the pool named by ``spec.shares_slots_with``."""

    _unit = "page"

    def __init__(
        self,
        spec: PoolSpec,
        num_pages: int,
        layout: Layout = Layout.PAGE_FIRST,
        pin_memory: bool | None = None,
        owner: HostPool | None = None,
    ) -> None:
        if not isinstance(spec, PoolSpec):
            raise InvalidArgumentError(f"spec must be a PoolSpec, got {type(spec).__name__}")
        if not isinstance(layout, Layout):
            raise InvalidArgumentError(f"layout must be a Layout, got {layout!r}")
        self.spec = spec
        self.layout = layout
        # A "slot" of a host pool's allocator is a whole page.
        self.allocator = self._owned_or_shared_allocator(num_pages, owner, 1)
        shape = buffer_shape(spec.layout, layout, self.allocator.num_pages)  # rejects RAW
        self.pinned = _resolve_pin(pin_memory)
        self.buffer = torch.zeros(shape, dtype=spec.layout.dtype.to_torch(), pin_memory=self.pinned)
        self._protected = torch.zeros(self.num_pages, dtype=torch.int32)
        self._sidecars: list[HostPool] = []
        if owner is not None:
            owner._sidecars.append(self)
        logger.debug("host pool %s: %s %s pinned=%s", spec.name, layout.label, shape, self.pinned)

    # -- protected sizes (the rest, in pages and in slots, are PoolBase's) -------------------

    @property
    def protected_pages(self) -> int:
        return int((self._protected > 0).sum())

    @property
    def protected_size(self) -> int:
        return self.protected_pages * self.page_size

    # -- allocation and protection -----------------------------------------------------------

    def alloc(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` page indices, or None when they do not fit; all or nothing."""
        self._check_owner("allocate")
        return self.allocator.alloc(num_pages)

    def free(self, pages: IndexLike) -> None:
        """Return pages; a free page raises DoubleFreeError, a protected one
        InvalidArgumentError, and then nothing is freed."""
        self._check_owner("free")
        index = check_indices(pages, self.num_pages, "page", distinct=False)  # repeats: double free
        for pool in (self, *self._sidecars):
            held = pool._protected[index] > 0
            if bool(held.any()):
                raise InvalidArgumentError(
                    f"pool {pool.spec.name!r} pages {index[held].tolist()} are protected"
                )
        self.allocator.free(index)

    def protect(self, pages: IndexLike) -> None:
        """Mark allocated pages in use outside the pool (e.g. being written to storage)."""
        index = self._allocated(pages)
        self._protected[index] += 1

    def release(self, pages: IndexLike) -> None:
        """Undo one :meth:`protect` of each page."""
        index = self._allocated(pages)
        if bool((self._protected[index] == 0).any()):
            raise InvalidArgumentError(f"releasing unprotected pages of {self.spec.name!r}")
        self._protected[index] -= 1

    def is_protected(self, pages: IndexLike) -> torch.Tensor:
        return self._protected[check_indices(pages, self.num_pages, "page")] > 0

    def is_allocated(self, pages: IndexLike) -> torch.Tensor:
        return self.allocator.is_allocated(check_indices(pages, self.num_pages, "page"))

    def _allocated(self, pages: IndexLike) -> torch.Tensor:
        index = check_indices(pages, self.num_pages, "page")
        free = ~self.allocator.is_allocated(index)
        if bool(free.any()):
            raise InvalidArgumentError(
                f"pool {self.spec.name!r} pages {index[free].tolist()} are not allocated"
            )
        return index

    # -- pages as memory, for storage --------------------------------------------------------

    def page_buffer(self, page: int) -> torch.Tensor:
        """One page as a contiguous view (page_first family): zero-copy puts and gets."""
        if self.layout is Layout.LAYER_FIRST:
            raise UnsupportedLayoutError(
                "a layer_first page is not contiguous; use page_segments()"
            )
        self._check_page(page)
        return self.buffer[page]

    def page_segments(self, page: int) -> list[memoryview]:
        """One page as flat byte views in stored order (one, or one per component and layer)."""
        self._check_page(page)
        return page_segments(self.buffer, self.spec.layout, self.layout, page)

    def read_page(self, page: int) -> torch.Tensor:
        """A contiguous copy of one page in stored order."""
        self._check_page(page)
        return read_page(self.buffer, self.spec.layout, self.layout, page)

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Copy one page (stored order, or its flat bytes) in; checked before writing."""
        self._check_page(page)
        write_page(self.buffer, self.spec.layout, self.layout, page, data)

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise InvalidArgumentError(f"page {page!r} out of range [0, {self.num_pages})")

    # -- device <-> host ---------------------------------------------------------------------

    def backup(
        self,
        device: DevicePool,
        slots: IndexLike,
        pages: IndexLike,
        *,
        layers: Sequence[int] | None = None,
        stream: TransferStream | None = None,
    ) -> LayerTransfer:
        """Copy device ``slots`` (whole pages' worth) into host ``pages``; per-layer events."""
        slot_index, page_index = self._transfer_args(device, slots, pages)
        return gather(
            device.buffer,
            slot_index,
            self.buffer,
            page_index,
            self.spec.layout,
            self.layout,
            layers=layers,
            stream=stream,
        )

    def load(
        self,
        pages: IndexLike,
        device: DevicePool,
        slots: IndexLike,
        *,
        layers: Sequence[int] | None = None,
        stream: TransferStream | None = None,
    ) -> LayerTransfer:
        """Copy host ``pages`` into device ``slots``; per-layer events (wait on layer i only)."""
        slot_index, page_index = self._transfer_args(device, slots, pages)
        return scatter(
            self.buffer,
            page_index,
            device.buffer,
            slot_index,
            self.spec.layout,
            self.layout,
            layers=layers,
            stream=stream,
        )

    def _transfer_args(
        self, device: DevicePool, slots: IndexLike, pages: IndexLike
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(device, DevicePool) or device.spec != self.spec:
            raise InvalidArgumentError(f"the device pool must hold pool {self.spec.name!r}")
        page_index = self._allocated(pages)
        slot_index = check_indices(slots, device.size, "slot")
        if bool((~device.allocator.is_allocated(slot_index)).any()):
            raise InvalidArgumentError("copying to or from device slots that are not allocated")
        return slot_index, page_index

    def __repr__(self) -> str:
        return (
            f"HostPool({self.spec.name!r}, {self.layout.label}, pages={self.num_pages}, "
            f"used={self.used_pages}, protected={self.protected_pages}, pinned={self.pinned})"
        )


def host_pools(
    model: ModelPools,
    pages: Mapping[str, int],
    layout: Layout = Layout.PAGE_FIRST,
    pin_memory: bool | None = None,
) -> dict[str, HostPool]:
    """A host pool per pool of ``model``; ``pages`` sizes each page owner (sidecars follow)."""

    def make(spec: PoolSpec, count: int, owner: HostPool | None) -> HostPool:
        return HostPool(spec, count, layout, pin_memory if owner is None else owner.pinned, owner)

    return build_pool_group(model, pages, "page", make)
