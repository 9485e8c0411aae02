"""Attention over the paged KV pool with torch's ``scaled_dot_product_attention``.

A step's chunks are laid out once (:class:`StepLayout`): their tokens concatenated, the
one-token chunks (decode) gathered into one batch with their context slots padded to the
longest, the longer chunks (prefill) kept apart. Per layer, the decode batch reads its keys and
values with one ``index_select`` over the pool and runs one SDPA call; each prefill chunk reads
its context the same way and runs one causal SDPA call. Query heads that share a KV head are
folded into the query axis, so K and V are never repeated per head (:func:`attend`, which every
attention of every model goes through). Keys and values are read in the queries' dtype: the
seeded model computes in float64 over a float32 pool.

:func:`gqa_attention` is the attention layer of the dense checkpoints, Jamba's attention layers
and the seeded model's full-attention layers: q/k/v projections (with biases and per-head norms
where the checkpoint has them), the rotary embedding where the model has one, the new K and V
written to their slots, attention over the pool, the output projection; :func:`gqa_shapes`
lists the tensors it reads, for a checkpoint's loader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.models.layers import rms_norm
from hicache.models.rope import Rotation
from hicache.pools.device import take_rows

__all__ = [
    "HeadSizes",
    "StepLayout",
    "attend",
    "cache_and_attend",
    "gqa_attention",
    "gqa_shapes",
    "paged_attention",
    "projected_heads",
    "qkv",
]


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
        k = take_rows(keys, layout.decode_slots).to(q.dtype)  # (B, T, Hk, D)
        v = take_rows(values, layout.decode_slots).to(q.dtype)
        out[rows] = attend(q[rows][:, None], k, v, layout.decode_mask)[:, 0]
    for chunk in layout.prefills:
        k = keys.index_select(0, chunk.slots)[None].to(q.dtype)
        v = values.index_select(0, chunk.slots)[None].to(q.dtype)
        out[chunk.rows] = attend(q[chunk.rows][None], k, v, chunk.mask[None, None])[0]
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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


@dataclass(frozen=True, slots=True)
class HeadSizes:
    heads: int
    kv_heads: int
    head_dim: int


def projected_heads(
    weights: Mapping[str, torch.Tensor],
    h: torch.Tensor,
    which: str,
    sizes: HeadSizes,
    rotation: Rotation | None,
    norm_eps: float,
) -> torch.Tensor:
    """One of :func:`qkv`'s outputs alone (``which``: ``"q"``, ``"k"`` or ``"v"``), computed
    exactly as :func:`qkv` computes it: a caller may take its keys first and its queries
    later (dsv4's HiSparse decode computes its queries while the hot buffer's copies run)."""
    n, attn = h.shape[0], "self_attn"
    out = F.linear(
        h, weights[f"{attn}.{which}_proj.weight"], weights.get(f"{attn}.{which}_proj.bias")
    )
    out = out.view(n, sizes.heads if which == "q" else sizes.kv_heads, sizes.head_dim)
    if which == "v":
        return out
    if f"{attn}.{which}_norm.weight" in weights:
        out = rms_norm(out, weights[f"{attn}.{which}_norm.weight"], norm_eps)
    return out if rotation is None else rotation(out)


def qkv(
    weights: Mapping[str, torch.Tensor],
    h: torch.Tensor,
    sizes: HeadSizes,
    rotation: Rotation | None,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's queries (N, H, D), keys and values (N, Hk, D) from the normed hidden states
    ``h``: ``self_attn.{q,k,v}_proj`` (their biases where ``weights`` has them), a per-head
    RMSNorm of q and k where it has ``self_attn.{q,k}_norm.weight`` (eps ``norm_eps``), then
    the rotation (none: no position embedding)."""
    q, k, v = (projected_heads(weights, h, x, sizes, rotation, norm_eps) for x in "qkv")
    return q, k, v


def gqa_attention(
    weights: Mapping[str, torch.Tensor],
    h: torch.Tensor,
    sizes: HeadSizes,
    rotation: Rotation | None,
    norm_eps: float,
    layout: StepLayout,
    pool: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """GQA over the whole context: :func:`qkv`, the new K and V written to their slots of
    ``layer`` in the K/V pool buffer ``pool``, attention over the pool, ``self_attn.o_proj``."""
    q, k, v = qkv(weights, h, sizes, rotation, norm_eps)
    mixed = cache_and_attend(layout, q, k, v, pool, layer)
    return F.linear(mixed, weights["self_attn.o_proj.weight"], weights.get("self_attn.o_proj.bias"))


def gqa_shapes(
    sizes: HeadSizes, hidden: int, *, biases: bool = False, qk_norm: bool = False
) -> dict[str, tuple[int, ...]]:
    """The tensors :func:`gqa_attention` reads (names below ``model.layers.{i}.``) with their
    shapes: the q/k/v/o projections, q/k/v biases when ``biases``, per-head q and k norms when
    ``qk_norm``."""
    q_dim, kv_dim = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q_dim, hidden),
        "self_attn.k_proj.weight": (kv_dim, hidden),
        "self_attn.v_proj.weight": (kv_dim, hidden),
        "self_attn.o_proj.weight": (hidden, q_dim),
    }
    if biases:
        shapes |= {
            "self_attn.q_proj.bias": (q_dim,),
            "self_attn.k_proj.bias": (kv_dim,),
            "self_attn.v_proj.bias": (kv_dim,),
        }
    if qk_norm:
        shapes |= {
            "self_attn.q_norm.weight": (sizes.head_dim,),
            "self_attn.k_norm.weight": (sizes.head_dim,),
        }
    return shapes
