"""Multi-head latent attention: each token caches one latent per layer (pool ``latent``), from
which every head's K and V come.

* :func:`mla_attention`: DeepSeek-V3's, as transformers computes it. What a token caches is
  SGLang's latent: ``kv_a_layernorm`` of the compressed KV (``kv_lora_rank`` dims) followed by
  its rotary key, already rotated. Prefill chunks attend in the naive form (each context
  token's per-head K and V expanded from its latent by ``kv_b_proj``); decode tokens in the
  absorbed form (the query taken into the latent space, so a step reads the context's latents
  and never expands them), both through torch's SDPA with the checkpoint's softmax scale.
* :func:`projected_latent_layer`: the seeded ``mla`` preset's, per chunk: K (rotated) and V
  projected from the latent by ``k_b_proj`` / ``v_b_proj``, then causal attention.

DSA's sparse latent attention is :mod:`hicache.models.sparse`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.models.attention import StepLayout, attend
from hicache.models.layers import rms_norm
from hicache.models.step import LayerContext, Step
from hicache.pools.device import take_rows

__all__ = ["MlaSizes", "mla_attention", "projected_latent_layer"]

INNER_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default


@dataclass(frozen=True, slots=True)
class MlaSizes:
    """The sizes of DeepSeek-V3's attention."""

    heads: int
    q_lora_rank: int | None  # None: the query is projected directly (``q_proj``)
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    softmax_scale: float  # includes yarn's mscale when the rope is scaled


def mla_attention(
    cfg: MlaSizes,
    layer: Mapping[str, torch.Tensor],
    h: torch.Tensor,
    step: Step,
    latents: torch.Tensor,
) -> torch.Tensor:
    """The step's new latents written to their slots of ``latents`` (slots, latent_dim), then
    each token's attention over its context read back from there."""
    n, layout, rotation = h.shape[0], step.layout, step.rotation
    assert rotation is not None  # DeepSeek-V3 always rotates
    q = _query(cfg, layer, h).view(n, cfg.heads, cfg.qk_nope_dim + cfg.qk_rope_dim)
    q_nope, q_rot = torch.split(q, [cfg.qk_nope_dim, cfg.qk_rope_dim], dim=-1)
    q_rot = rotation(q_rot)
    attn = "self_attn.kv_a_proj_with_mqa"
    kv = F.linear(h, layer[f"{attn}.weight"], layer.get(f"{attn}.bias"))
    compressed, k_rot = torch.split(kv, [cfg.kv_lora_rank, cfg.qk_rope_dim], dim=-1)
    compressed = rms_norm(compressed, layer["self_attn.kv_a_layernorm.weight"], INNER_EPS)
    k_rot = rotation(k_rot[:, None])[:, 0]
    latents[layout.new_slots] = torch.cat((compressed, k_rot), dim=-1).to(latents.dtype)
    out = h.new_empty(n, cfg.heads * cfg.v_dim)
    kv_b = layer["self_attn.kv_b_proj.weight"]
    if len(layout.decode_rows):
        rows = layout.decode_rows
        out[rows] = _absorbed(cfg, kv_b, q_nope[rows], q_rot[rows], latents, layout)
    for chunk in layout.prefills:
        full = torch.cat((q_nope[chunk.rows], q_rot[chunk.rows]), dim=-1)
        context = latents.index_select(0, chunk.slots)
        out[chunk.rows] = _expanded(cfg, kv_b, full, context.to(h.dtype), chunk.mask)
    return F.linear(out, layer["self_attn.o_proj.weight"], layer.get("self_attn.o_proj.bias"))


def _query(cfg: MlaSizes, layer: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    if cfg.q_lora_rank is None:
        return F.linear(h, layer["self_attn.q_proj.weight"])
    low = F.linear(h, layer["self_attn.q_a_proj.weight"], layer.get("self_attn.q_a_proj.bias"))
    low = rms_norm(low, layer["self_attn.q_a_layernorm.weight"], INNER_EPS)
    return F.linear(low, layer["self_attn.q_b_proj.weight"])


def _expanded(
    cfg: MlaSizes, kv_b: torch.Tensor, q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """A prefill chunk's queries ``q`` (n, H, qk dim) over its ``context`` latents
    (T, latent_dim), each expanded to per-head K and V as transformers does: (n, H * v)."""
    t = context.shape[0]
    nope, rot = torch.split(context, [cfg.kv_lora_rank, cfg.qk_rope_dim], dim=-1)
    kv = F.linear(nope, kv_b).view(t, cfg.heads, cfg.qk_nope_dim + cfg.v_dim)
    k_nope, v = torch.split(kv, [cfg.qk_nope_dim, cfg.v_dim], dim=-1)
    k = torch.cat((k_nope, rot[:, None].expand(t, cfg.heads, cfg.qk_rope_dim)), dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask[None, None], scale=cfg.softmax_scale,
    )  # fmt: skip
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def _absorbed(
    cfg: MlaSizes,
    kv_b: torch.Tensor,
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latents: torch.Tensor,
    layout: StepLayout,
) -> torch.Tensor:
    """The decode rows' attention in the latent space: ``kv_b_proj``'s key half folded into
    the queries (B, H, nope), so the context's latents are the one shared K (and their
    compressed part the V) of every head, then its value half applied: (B, H * v)."""
    kv_b = kv_b.view(cfg.heads, cfg.qk_nope_dim + cfg.v_dim, cfg.kv_lora_rank)
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, kv_b[:, : cfg.qk_nope_dim])
    q = torch.cat((q_latent, q_rot), dim=-1)[:, None]  # the heads on the query axis
    context = take_rows(latents, layout.decode_slots).to(q.dtype)[:, None]  # (B, 1, T, L)
    out = F.scaled_dot_product_attention(
        q, context, context[..., : cfg.kv_lora_rank], attn_mask=layout.decode_mask,
        scale=cfg.softmax_scale,
    )  # fmt: skip
    mixed = torch.einsum("bhr,hvr->bhv", out[:, 0], kv_b[:, cfg.qk_nope_dim :])
    return mixed.reshape(q.shape[0], -1)


def projected_latent_layer(
    ctx: LayerContext, weights: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step, layer: int
) -> torch.Tensor:
    """The seeded MLA layer over each chunk of the step: its latents (``kv_a_proj``) cached,
    then every context token's K (rotated at its position) and V projected from its latent."""
    c, store = ctx.config, step.pools["latent"].buffer
    outs = []
    for rows, chunk in step.each():
        x = h[rows]
        n, total = x.shape[0], len(chunk.slots)
        store[0, layer, chunk.new_slots] = (
            F.linear(x, weights["self_attn.kv_a_proj.weight"]).view(n, 1, -1).to(store.dtype)
        )
        latent = store[0, layer, chunk.slots].to(ctx.dtype).view(total, -1)
        key_pos = torch.arange(total, device=h.device)
        k = F.linear(latent, weights["self_attn.k_b_proj.weight"])
        k = ctx.rope(k.view(total, c.heads, c.head_dim), key_pos)
        v = F.linear(latent, weights["self_attn.v_b_proj.weight"]).view(total, c.heads, c.head_dim)
        q = F.linear(x, weights["self_attn.q_proj.weight"]).view(n, c.heads, c.head_dim)
        rotation = step.rotation_of(rows)
        assert rotation is not None  # the seeded model always rotates
        mask = key_pos[None, :] <= chunk.positions[:, None]
        mixed = attend(rotation(q)[None], k[None], v[None], mask[None, None])[0]
        outs.append(F.linear(mixed, weights["self_attn.o_proj.weight"]))
    return torch.cat(outs)
