"""Attention over the paged KV pool with torch's ``scaled_dot_product_attention``.

A step's chunks are laid out once (:class:`StepLayout`): their tokens concatenated, the
one-token chunks (decode) gathered into one batch with their context slots padded to the
longest, the longer chunks (prefill) kept apart. Per layer, the decode batch reads its keys and
values with one ``index_select`` over the pool and runs one SDPA call; each prefill chunk reads
its context the same way and runs one causal SDPA call. Query heads that share a KV head are
folded into the query axis, so K and V are never repeated per head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.pools.device import take_rows

__all__ = ["StepLayout", "cache_and_attend", "paged_attention"]


@dataclass(frozen=True, slots=True)
class _Prefill:
    rows: slice  # its tokens in the step
    slots: torch.Tensor  # (T,) context slots, its own new tokens' last
    mask: torch.Tensor  # (n, T) which keys each query sees (causal)


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each chunk's tokens sit in the step, and what their attention reads."""

    positions: torch.Tensor  # (N,) every token's position
    new_slots: torch.Tensor  # (N,) every token's slot, where its K and V are written
    last_rows: torch.Tensor  # (chunks,) each chunk's last token in the step
    decode_rows: torch.Tensor  # (B,) the one-token chunks' tokens
    decode_slots: torch.Tensor  # (B, Tmax) their context slots, padded with a real slot
    decode_mask: torch.Tensor  # (B, 1, 1, Tmax) the real ones
    prefills: tuple[_Prefill, ...]

    @classmethod
    def of(
        cls, starts: Sequence[int], slots: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> StepLayout:
        """Chunks of ``lengths[i]`` new tokens at positions ``starts[i] ..`` whose context
        (positions 0 through the last new one) has ``slots[i]``."""
        device = slots[0].device
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        positions = torch.cat(
            [torch.arange(s, s + n, device=device) for s, n in zip(starts, lengths, strict=True)]
        )
        new_slots = torch.cat([s[-n:] for s, n in zip(slots, lengths, strict=True)])
        decode = [i for i, n in enumerate(lengths) if n == 1]
        context = [slots[i] for i in decode]
        width = max((len(s) for s in context), default=1)
        padded = torch.zeros(len(decode), width, dtype=torch.int64, device=device)
        mask = torch.zeros(len(decode), 1, 1, width, dtype=torch.bool, device=device)
        for row, s in enumerate(context):
            padded[row, : len(s)] = s
            mask[row, ..., : len(s)] = True
        prefills = tuple(
            _Prefill(
                slice(bounds[i], bounds[i + 1]), slots[i], _causal(starts[i], lengths[i], slots[i])
            )
            for i, n in enumerate(lengths)
            if n > 1
        )
        return cls(
            positions, new_slots, torch.tensor(bounds[1:], device=device) - 1,
            torch.tensor([bounds[i] for i in decode], dtype=torch.int64, device=device),
            padded, mask, prefills,
        )  # fmt: skip


def _causal(start: int, n: int, slots: torch.Tensor) -> torch.Tensor:
    keys = torch.arange(len(slots), device=slots.device)
    queries = torch.arange(start, start + n, device=slots.device)
    return keys[None, :] <= queries[:, None]


def paged_attention(
    layout: StepLayout, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Attention of the step's queries ``q`` (N, H, D) over one layer's pool ``keys`` and
    ``values`` (S, Hk, D), after the step's own K and V were written there: (N, H * D)."""
    n, heads, dim = q.shape
    out = q.new_empty(n, heads * dim)
    if len(layout.decode_rows):
        rows = layout.decode_rows
        k = take_rows(keys, layout.decode_slots)  # (B, T, Hk, D)
        v = take_rows(values, layout.decode_slots)
        out[rows] = _grouped(q[rows][:, None], k, v, layout.decode_mask)[:, 0]
    for chunk in layout.prefills:
        k = keys.index_select(0, chunk.slots)[None]
        v = values.index_select(0, chunk.slots)[None]
        out[chunk.rows] = _grouped(q[chunk.rows][None], k, v, chunk.mask[None, None])[0]
    return out


def cache_and_attend(
    layout: StepLayout,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """Write the step's new ``k`` and ``v`` (N, Hk, D) to their slots of ``layer`` in a K/V
    pool buffer (2, layers, S, Hk, D), then :func:`paged_attention`: (N, H * D)."""
    keys, values = pool[0, layer], pool[1, layer]
    keys[layout.new_slots] = k.to(keys.dtype)
    values[layout.new_slots] = v.to(values.dtype)
    return paged_attention(layout, q, keys, values)


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of queries (B, n, H, D) over keys and values (B, T, Hk, D) where ``mask``
    (B, 1, n or 1, T) allows: (B, n, H * D). The H / Hk query heads of a KV head are stacked
    on the query axis (mask repeated to match)."""
    b, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    stacked = (
        q.view(b, n, kv_heads, group, dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(b, kv_heads, group * n, dim)
    )
    mask = mask.expand(b, 1, n, mask.shape[-1]).repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(
        stacked, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )  # (B, Hk, G * n, D)
    return out.view(b, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4).reshape(b, n, heads * dim)
