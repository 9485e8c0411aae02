"""What a tree needs of the pools whose slots its nodes hold.

A tree frees the slots of the nodes it evicts, and the request lifecycle frees duplicates; the
tiered cache also allocates through the same object. The device pools
(:class:`~hicache.pools.device.DevicePool`) and the plain
:class:`~hicache.pools.allocator.TokenSlotAllocator` fit, as does any test double with the
two methods. :func:`concat_slots` joins the slots of a path's nodes, as every match returns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hicache.errors import HiCacheError

__all__ = ["SlotAllocator", "concat_slots"]


class SlotAllocator(Protocol):
    """Hands out and takes back slot indices (1-D int64 tensors)."""

    # Positional-only: the pools name the count differently (num_tokens, num_slots).
    def alloc(self, count: int, /) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor, /) -> None: ...


def concat_slots(values: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The device slots of consecutive nodes (``node.value``) as one tensor."""
    slots = [v for v in values if v is not None]
    if len(slots) != len(values):  # a gap would shift every later slot: refuse it
        raise HiCacheError("a node on a device path holds no device slots")
    if not slots:
        return torch.empty(0, dtype=torch.int64)
    return slots[0] if len(slots) == 1 else torch.cat(slots)
