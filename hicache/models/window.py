"""Sliding-window attention over the window pool's own slots (``swa``): the seeded model's
window layers, and the window half of its dsv4 layers (:mod:`hicache.models.compressed`).

A query at ``q`` sees ``q - window + 1 .. q``. The chunk's new K and V are written to their
``swa`` slots, then only the positions its window reaches are read back; a slot of -1 there is
an error (the pool holds nothing for it), anywhere before it is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.errors import InvalidArgumentError, MissingSlotError
from hicache.models.attention import HeadSizes, attend, qkv
from hicache.models.step import LayerContext, Step
from hicache.models.types import ChunkInput
from hicache.pools.device import DevicePool

__all__ = ["WindowRead", "window_layer", "window_read"]


@dataclass(frozen=True, slots=True)
class WindowRead:
    """What a chunk's queries read back from the window pool: the pool's slots of positions
    ``0 .. end - 1``, the keys and values of positions ``lo .. end - 1`` (in the model's dtype)
    and which of them each query sees (``mask`` (n, end - lo))."""

    slots: torch.Tensor
    lo: int
    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


def window_read(
    pool: DevicePool,
    layer: int,
    chunk: ChunkInput,
    kv: tuple[torch.Tensor, torch.Tensor],
    window: int,
    dtype: torch.dtype,
) -> WindowRead:
    """Write the chunk's new K and V (``kv``) to their window slots of ``layer``, then read
    back what its queries' windows reach."""
    slots, lo, seen = _window_slots(pool.spec.name, window, chunk)
    store = pool.buffer.dtype
    k, v = kv
    pool.buffer[0, layer, slots[chunk.start :]] = k.to(store)
    pool.buffer[1, layer, slots[chunk.start :]] = v.to(store)
    key_pos = torch.arange(lo, chunk.end, device=seen.device)[None, :]
    queries = chunk.positions[:, None]
    mask = (key_pos <= queries) & (key_pos > queries - window)
    keys, values = pool.buffer[0, layer, seen].to(dtype), pool.buffer[1, layer, seen].to(dtype)
    return WindowRead(slots, lo, keys, values, mask)


def _window_slots(
    name: str, window: int, chunk: ChunkInput
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The window pool's slots of positions ``0 .. end - 1``, the first position the chunk's
    window reaches, and the slots from there on (MissingSlotError for a -1 there)."""
    slots = chunk.pool_slots.get(name)
    end = chunk.end
    if slots is None or len(slots) != end:
        got = "none" if slots is None else f"{len(slots)}"
        raise InvalidArgumentError(
            f"window layers need {end} {name!r} slots (positions 0..{end - 1}), got {got}"
        )
    lo = max(0, chunk.start - window + 1)
    seen = slots[lo:end]
    if bool((seen < 0).any()):
        missing = (lo + torch.nonzero(seen < 0)[0]).item()
        raise MissingSlotError(
            f"pool {name!r} holds no slot for position {missing}, inside the window of the "
            f"chunk at {chunk.start}..{end - 1}"
        )
    return slots, lo, seen


def window_layer(
    ctx: LayerContext, weights: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step, layer: int
) -> torch.Tensor:
    """The seeded model's sliding-window layer over each chunk of the step, through the
    window pool's own slots (``ChunkInput.pool_slots``)."""
    c = ctx.config
    sizes = HeadSizes(c.heads, c.kv_heads, c.head_dim)
    outs = []
    for rows, chunk in step.each():
        q, k, v = qkv(weights, h[rows], sizes, step.rotation_of(rows), 0.0)
        read = window_read(step.pools["swa"], layer, chunk, (k, v), c.window, ctx.dtype)
        mixed = attend(q[None], read.keys[None], read.values[None], read.mask[None, None])[0]
        outs.append(F.linear(mixed, weights["self_attn.o_proj.weight"]))
    return torch.cat(outs)
