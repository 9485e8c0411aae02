"""A paged allocator of token slots (indices into a KV pool), CPU tensors.

Slots are handed out in whole pages: slot ``p * page_size + i`` is token ``i`` of page ``p``.
Allocation is all or nothing (``None`` when there are not enough free pages), and freeing a page
that is already free raises :class:`DoubleFreeError` before anything changes.
"""

from __future__ import annotations

import torch

from hicache.errors import DoubleFreeError, InvalidArgumentError

__all__ = ["TokenSlotAllocator"]


class TokenSlotAllocator:
    """``size`` token slots in pages of ``page_size``."""

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu") -> None:
        if page_size <= 0 or size <= 0 or size % page_size:
            raise InvalidArgumentError(
                f"size ({size}) must be a positive multiple of page_size ({page_size})"
            )
        self.size = size
        self.page_size = page_size
        self.device = device
        self.num_pages = size // page_size
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() -> 0 first
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    @property
    def available_size(self) -> int:
        """Free slots (whole pages only)."""
        return len(self._free_pages) * self.page_size

    def is_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot, whether its page is allocated (slots must be in range)."""
        return ~self._is_free[slots.reshape(-1) // self.page_size]

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` (a multiple of page_size), or None if they do not fit."""
        if num_tokens < 0 or num_tokens % self.page_size:
            raise InvalidArgumentError(
                f"allocate a non-negative multiple of page_size {self.page_size}, not {num_tokens}"
            )
        n_pages = num_tokens // self.page_size
        if n_pages > len(self._free_pages):
            return None
        pages = [self._free_pages.pop() for _ in range(n_pages)]
        page_tensor = torch.tensor(pages, dtype=torch.int64)
        self._is_free[page_tensor] = False
        return (page_tensor[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages; every page of ``slots`` must be allocated (checked first)."""
        if slots.numel() == 0:
            return
        if slots.numel() % self.page_size:
            raise InvalidArgumentError(f"free whole pages of {self.page_size} slots")
        pages = slots.reshape(-1, self.page_size)[:, 0] // self.page_size
        if bool(((pages < 0) | (pages >= self.num_pages)).any()):
            raise InvalidArgumentError("slot index out of range")
        if torch.unique(pages).numel() != pages.numel():
            raise DoubleFreeError("the same page appears twice in one free")
        if bool(self._is_free[pages].any()):
            already = pages[self._is_free[pages]].tolist()
            raise DoubleFreeError(f"freeing pages that are already free: {already}")
        self._is_free[pages] = True
        self._free_pages.extend(pages.tolist())
