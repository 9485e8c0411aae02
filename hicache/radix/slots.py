"""What a tree needs of the pools whose slots its nodes hold.

A tree frees the slots of the nodes it evicts, and the request lifecycle frees duplicates; the
tiered cache also allocates through the same object. The device pools
(:class:`~hicache.pools.device.DevicePool`) and the plain
:class:`~hicache.pools.allocator.TokenSlotAllocator` fit, as does any test double with the
two methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["SlotAllocator"]


class SlotAllocator(Protocol):
    """Hands out and takes back slot indices (1-D int64 tensors)."""

    # Positional-only: the pools name the count differently (num_tokens, num_slots).
    def alloc(self, count: int, /) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor, /) -> None: ...
