"""The seeded model: a small decoder-only transformer with random weights drawn from
``config.seed``, one layer kind per preset, built from the same blocks as the checkpoints.

RMSNorm, the rotary embedding (interleaved pairs), the SwiGLU MLP and, per layer kind, token
mixing whose cached state lives in the device pools: GQA attention over ``kv``
(:mod:`hicache.models.attention`, as the dense checkpoints), sliding-window attention over
``swa`` (:mod:`hicache.models.window`), MLA over ``latent`` (:mod:`hicache.models.latent`),
DSA's sparse latent attention with its indexer (:mod:`hicache.models.sparse`), a Mamba-like
recurrent layer over ``conv`` / ``ssm`` (:mod:`hicache.models.recurrent`), and dsv4's
compressed layers (:mod:`hicache.models.compressed`). A forward pass writes the new tokens'
state into their slots and then reads every context token's state back from the pool, so a
prefix computed now and one loaded from host or L3 are read the same way.

Why outputs do not depend on the cache: on the CPU, matmuls and reductions run in float64 and
everything stored is rounded to the pool's dtype (float32), so the order in which a kernel sums
(which changes with the number of tokens in a chunk) moves results by ~1e-16, far below float32's
rounding step; the recurrent state is rounded to its storage dtype at every step, so resuming from
a stored state is the same computation. On CUDA the model computes in float32 with bfloat16 pools.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hicache.models.attention import HeadSizes, gqa_attention
from hicache.models.compressed import compressed_layer
from hicache.models.config import LayerKind, ModelConfig, layer_group, pool_of
from hicache.models.latent import projected_latent_layer
from hicache.models.recurrent import seeded_recurrent_layer
from hicache.models.rope import Pairing, RopeConfig, RotaryTable, inverse_frequencies
from hicache.models.sparse import rope_dim, sparse_latent_layer
from hicache.models.step import LayerContext, PagedDecoder, Step
from hicache.models.types import DecodePages
from hicache.models.window import window_layer

__all__ = ["TinyTransformer"]

_EPS = 1e-6


class TinyTransformer(PagedDecoder):
    """Weights drawn from ``config.seed``; :meth:`forward_batch` runs a step of chunks."""

    pairing = Pairing.INTERLEAVED

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        self.eps = _EPS
        gen = torch.Generator().manual_seed(config.seed)

        def draw(*shape: int, scale: float | None = None) -> torch.Tensor:
            std = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            t = torch.randn(*shape, generator=gen, dtype=torch.float64) * std
            return t.to(self.device, self.dtype)

        c = config
        self.embed = draw(c.vocab_size, c.hidden, scale=1.0)
        self.lm_head = draw(c.hidden, c.vocab_size).T.contiguous()  # (vocab, hidden), as read
        self.norm = torch.ones(c.hidden, dtype=self.dtype, device=self.device)
        self.kinds = c.layer_kinds()
        self.layers = [_layer_weights(c, kind, draw, self.norm) for kind in self.kinds]
        rotary = inverse_frequencies(RopeConfig(), c.head_dim, torch.float64)
        latent = inverse_frequencies(RopeConfig(), rope_dim(c.latent_dim), torch.float64)
        self.rotary = RotaryTable(rotary.to(self.device, self.dtype))
        self.ctx = LayerContext(
            c, self.dtype, self.rotary, RotaryTable(latent.to(self.device, self.dtype))
        )

    def check_hot(self, hot: DecodePages | None) -> None:
        """A hot buffer serves the DSA layers' HiSparse rows (:mod:`hicache.models.sparse`)."""

    def mix(self, index: int, h: torch.Tensor, step: Step) -> torch.Tensor:
        c, w = self.config, self.layers[index]
        kind, numbers = self.kinds[index], self.pool_numbers[index]
        if layer_group(kind) is not None:
            return compressed_layer(self.ctx, w, h, step, kind, numbers)
        layer = numbers[pool_of(kind)]
        if kind is LayerKind.ATTENTION:
            sizes, kv = HeadSizes(c.heads, c.kv_heads, c.head_dim), step.pools["kv"].buffer
            return gqa_attention(w, h, sizes, step.rotation, _EPS, step.layout, kv, layer)
        if kind is LayerKind.WINDOW:
            return window_layer(self.ctx, w, h, step, layer)
        if kind is LayerKind.LATENT:
            return projected_latent_layer(self.ctx, w, h, step, layer)
        if kind is LayerKind.SPARSE_LATENT:
            return sparse_latent_layer(self.ctx, w, h, step, layer)
        return seeded_recurrent_layer(self.ctx, w, h, step, layer)


Draw = Callable[..., torch.Tensor]  # (*shape, scale=None) -> the next seeded draw
Raw = dict[str, torch.Tensor]  # name -> (in, out) matrix


def _layer_weights(
    c: ModelConfig, kind: LayerKind, draw: Draw, ones: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One layer's seeded weights, drawn in a fixed order (the seed gives the same model in
    every version), stored as ``F.linear`` takes them: (out, in) views of (in, out) draws."""
    h = c.hidden
    raw: Raw = {}
    raw["mlp.gate_proj"], raw["mlp.up_proj"] = draw(h, 2 * h), draw(h, 2 * h)
    raw["mlp.down_proj"] = draw(2 * h, h)
    weights: dict[str, torch.Tensor] = {}
    if kind is LayerKind.RECURRENT:
        weights = _recurrent(c, draw, raw)
    else:
        q_dim = c.heads * c.head_dim
        raw["self_attn.q_proj"], raw["self_attn.o_proj"] = draw(h, q_dim), draw(q_dim, h)
    if kind in (LayerKind.ATTENTION, LayerKind.WINDOW):
        _kv(c, draw, raw)
    if kind in (LayerKind.LATENT, LayerKind.SPARSE_LATENT):
        _latent(c, draw, raw, c.latent_dim)
    if kind is LayerKind.SPARSE_LATENT:  # the latent's last dims are its rotary key
        raw["indexer.q_proj"], raw["indexer.k_proj"] = draw(h, c.index_dim), draw(h, c.index_dim)
        r = rope_dim(c.latent_dim)
        _latent(c, draw, raw, c.latent_dim - r, up_only=True)
        raw["self_attn.q_rope_proj"] = draw(h, c.heads * r)
    if layer_group(kind) is not None:
        _compressed(c, kind, draw, raw)
    weights |= {f"{name}.weight": matrix.T for name, matrix in raw.items()}
    weights["input_layernorm.weight"] = ones
    weights["post_attention_layernorm.weight"] = ones.clone()
    return weights


def _recurrent(c: ModelConfig, draw: Draw, raw: Raw) -> dict[str, torch.Tensor]:
    """The recurrent mixer's projections into ``raw``; its conv weights and decay returned."""
    h, inner = c.hidden, c.state_inner
    raw["mixer.in_proj"], raw["mixer.out_proj"] = draw(h, inner), draw(inner, h)
    conv = draw(c.conv_kernel, inner, scale=1.0 / math.sqrt(c.conv_kernel))
    raw["mixer.b_proj"], raw["mixer.c_proj"] = draw(h, c.state_dim), draw(h, c.state_dim)
    decay = torch.sigmoid(draw(inner, scale=1.0) + 2.0)
    return {"mixer.conv": conv, "mixer.decay": decay}


def _kv(c: ModelConfig, draw: Draw, raw: Raw) -> None:
    kv_dim = c.kv_heads * c.head_dim
    raw["self_attn.k_proj"], raw["self_attn.v_proj"] = (
        draw(c.hidden, kv_dim),
        draw(c.hidden, kv_dim),
    )


def _latent(c: ModelConfig, draw: Draw, raw: Raw, dim: int, up_only: bool = False) -> None:
    """MLA: the latent's projection down from the hidden state (unless ``up_only``), then K
    and V up from its ``dim`` dims."""
    q_dim = c.heads * c.head_dim
    if not up_only:
        raw["self_attn.kv_a_proj"] = draw(c.hidden, c.latent_dim)
    raw["self_attn.k_b_proj"], raw["self_attn.v_b_proj"] = draw(dim, q_dim), draw(dim, q_dim)


def _compressed(c: ModelConfig, kind: LayerKind, draw: Draw, raw: Raw) -> None:
    """dsv4: window K/V, and entries compressed from a group's K then V."""
    _kv(c, draw, raw)
    group = layer_group(kind)
    assert group is not None
    kv_dim, ratio = c.kv_heads * c.head_dim, group[1]
    dim = c.c4_dim if kind is LayerKind.COMPRESSED_SPARSE else c.c128_dim
    raw["self_attn.compress_proj"] = draw(2 * ratio * kv_dim, dim)
    raw["self_attn.k_b_proj"], raw["self_attn.v_b_proj"] = draw(dim, kv_dim), draw(dim, kv_dim)
    if kind is LayerKind.COMPRESSED_SPARSE:
        raw["indexer.q_proj"], raw["indexer.k_proj"] = (
            draw(c.hidden, c.index_dim),
            draw(dim, c.index_dim),
        )
