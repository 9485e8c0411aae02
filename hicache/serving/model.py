"""A small decoder-only transformer over the paged device pools, with seeded random weights.

RMSNorm, RoPE, attention whose K/V (or MLA latent, DSA indexer keys, sliding-window K/V, dsv4's
compressed entries and their indexer keys) live in the device pools, Mamba-like recurrent layers
whose state lives in the state pools, and a SwiGLU MLP. A forward pass writes the new tokens'
cached state into their slots and then reads every context token's state back from the pool, so a
prefix computed now and one loaded from host or L3 are read the same way. Sliding-window layers
(and dsv4's layers, for their window) read only their window, through the ``swa`` pool's own
slots; recurrent layers start from the request's working state slot and leave the state there,
copying it into snapshot slots at the positions the chunk asks for.

Why outputs do not depend on the cache: on the CPU, matmuls and reductions run in float64 and
everything stored is rounded to the pool's dtype (float32), so the order in which a kernel sums
(which changes with the number of tokens in a chunk) moves results by ~1e-16, far below float32's
rounding step; the recurrent state is rounded to its storage dtype at every step, so resuming from
a stored state is the same computation. On CUDA the model computes in float32 with bfloat16 pools.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache.pools.device import DevicePool
from hicache.serving.model_compressed import compressed_layer
from hicache.serving.model_layers import (
    AttentionInputs,
    attention_layer,
    latent_layer,
    recurrent_layer,
    rotary_frequencies,
    rotate,
    window_layer,
)
from hicache.serving.model_sparse import (
    DecodePages,
    decode_rows,
    rope_dim,
    sparse_latent_outputs,
)
from hicache.serving.presets import LayerKind, ModelConfig, layer_group, pool_of

__all__ = ["ChunkInput", "ServingModel", "TinyTransformer"]

LayerWait = Callable[[str, int], None]  # (pool, layer in pool): wait until loaded


class ServingModel(Protocol):
    """What the serving engine runs: this module's seeded model, or a checkpoint's
    (:mod:`hicache.checkpoint`). ``config`` names the pools it reads and writes."""

    config: ModelConfig
    device: torch.device  # where its pools are allocated

    def forward_batch(
        self,
        chunks: Sequence[ChunkInput],
        pools: Mapping[str, DevicePool],
        wait: LayerWait | None = None,
        hot: DecodePages | None = None,
    ) -> list[torch.Tensor]: ...


@dataclass(slots=True)
class ChunkInput:
    """New tokens of one request at positions ``start ...``, and the slots of every position
    from 0 through the last new one (the cached prefix's, then the new tokens').

    The extra pools, for models that have them: ``pool_slots`` gives each extra per-token pool
    (``swa``) its slots of positions ``0 .. start + n - 1``, -1 where the pool holds nothing (a
    window layer reads only its window, and a -1 there is an error); ``state_slot`` is the
    request's working slot in the state pools (``conv``, and ``ssm`` on the same index), holding
    the state after ``start`` tokens (ignored when ``start`` is 0: the state starts at zeros) and
    left holding the state after ``start + n``; ``state_from``, when set, is the slot to read
    the state after ``start`` tokens from instead (a cached snapshot: read per layer, after any
    load into it); ``snapshots`` maps a position ``p`` in ``start .. start + n`` to a state slot
    that receives the state after ``p`` tokens.

    HiSparse (a DSA decode token, ``hot_row`` set): ``slots`` are the request's slots in the hot
    buffer's indexer pool, and its latent is reached through its row of the hot buffer.
    """

    tokens: torch.Tensor  # (n,) int64
    start: int
    slots: torch.Tensor  # (start + n,) int64 device slots
    pool_slots: dict[str, torch.Tensor] = field(default_factory=dict)
    state_slot: int | None = None
    snapshots: dict[int, int] = field(default_factory=dict)
    state_from: int | None = None
    hot_row: int | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class TinyTransformer:
    """Weights drawn from ``config.seed``; ``forward`` runs one chunk of one request."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        gen = torch.Generator().manual_seed(config.seed)
        c = config
        q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            std = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            t = torch.randn(*shape, generator=gen, dtype=torch.float64) * std
            return t.to(self.device, self.dtype)

        self.embed = w(c.vocab_size, c.hidden, scale=1.0)
        self.unembed = w(c.hidden, c.vocab_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in c.layer_kinds():
            p = {"norm1": torch.ones(c.hidden, dtype=self.dtype, device=self.device)}
            p["norm2"] = p["norm1"].clone()
            p["w1"], p["w3"] = w(c.hidden, 2 * c.hidden), w(c.hidden, 2 * c.hidden)
            p["w2"] = w(2 * c.hidden, c.hidden)
            if kind is LayerKind.RECURRENT:
                inner = c.state_inner
                p["w_in"], p["w_out"] = w(c.hidden, inner), w(inner, c.hidden)
                p["conv"] = w(c.conv_kernel, inner, scale=1.0 / math.sqrt(c.conv_kernel))
                p["w_b"], p["w_c"] = w(c.hidden, c.state_dim), w(c.hidden, c.state_dim)
                p["decay"] = torch.sigmoid(w(inner, scale=1.0) + 2.0)
            else:
                p["wq"], p["wo"] = w(c.hidden, q_dim), w(q_dim, c.hidden)
            if kind in (LayerKind.ATTENTION, LayerKind.WINDOW):
                p["wk"], p["wv"] = w(c.hidden, kv_dim), w(c.hidden, kv_dim)
            if kind in (LayerKind.LATENT, LayerKind.SPARSE_LATENT):
                p["w_dkv"] = w(c.hidden, c.latent_dim)
                p["w_uk"], p["w_uv"] = w(c.latent_dim, q_dim), w(c.latent_dim, q_dim)
            if kind is LayerKind.SPARSE_LATENT:  # the latent's last dims are its rotary key
                p["w_iq"], p["w_ik"] = w(c.hidden, c.index_dim), w(c.hidden, c.index_dim)
                r = rope_dim(c.latent_dim)
                p["w_uk"], p["w_uv"] = w(c.latent_dim - r, q_dim), w(c.latent_dim - r, q_dim)
                p["w_qr"] = w(c.hidden, c.heads * r)
            group = layer_group(kind)
            if group is not None:  # dsv4: window K/V, and entries compressed from them
                p["wk"], p["wv"] = w(c.hidden, kv_dim), w(c.hidden, kv_dim)
                ratio = group[1]
                dim = c.c4_dim if kind is LayerKind.COMPRESSED_SPARSE else c.c128_dim
                p["w_comp"] = w(2 * ratio * kv_dim, dim)  # a group's K then V -> its entry
                p["w_uk"], p["w_uv"] = w(dim, kv_dim), w(dim, kv_dim)
                if kind is LayerKind.COMPRESSED_SPARSE:
                    p["w_iq"], p["w_ik"] = w(c.hidden, c.index_dim), w(dim, c.index_dim)
            self.layers.append(p)
        self._inv_freq = rotary_frequencies(c.head_dim).to(self.device, self.dtype)
        # DSA: the rotary key at the end of the latent (see model_sparse.rope_dim)
        latent_rope = rotary_frequencies(rope_dim(c.latent_dim))
        self.latent_rope_freq = latent_rope.to(self.device, self.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary position embedding over the last dim of ``x`` (n, heads, head_dim)."""
        return rotate(x, positions[:, None], self._inv_freq)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def forward(
        self,
        chunk: ChunkInput,
        pools: Mapping[str, DevicePool],
        wait: LayerWait | None = None,
    ) -> torch.Tensor:
        """Logits of the chunk's last token (vocab,), after caching the chunk's state."""
        return self.forward_batch([chunk], pools, wait)[0]

    @torch.no_grad()
    def forward_batch(
        self,
        chunks: Sequence[ChunkInput],
        pools: Mapping[str, DevicePool],
        wait: LayerWait | None = None,
        hot: DecodePages | None = None,
    ) -> list[torch.Tensor]:
        """One step over several requests' chunks: the per-token work (norms, MLP, output
        projection) runs on all tokens at once, attention per request over its own context
        (DSA decode tokens batched, their latent from ``hot`` for HiSparse rows).
        Returns each chunk's last-token logits (vocab,) in float32 on the CPU."""
        c = self.config
        inputs, token_ids = [], []
        for chunk in chunks:
            tokens = chunk.tokens.to(self.device)
            if len(tokens) == 0:
                raise ValueError("a chunk needs at least one token")
            positions = torch.arange(chunk.start, chunk.start + len(tokens), device=self.device)
            inputs.append(
                AttentionInputs(
                    chunk.slots.to(self.device), chunk.start, positions,
                    {name: s.to(self.device) for name, s in chunk.pool_slots.items()},
                    chunk.state_slot, dict(chunk.snapshots), chunk.state_from, chunk.hot_row,
                )
            )  # fmt: skip
            token_ids.append(tokens)
        bounds = [0]
        for tokens in token_ids:
            bounds.append(bounds[-1] + len(tokens))
        ids = torch.cat(token_ids)
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:  # once for the whole step
            raise ValueError(f"token ids must be in [0, {c.vocab_size})")
        x = self.embed[ids]
        step = None  # the DSA layers' view of the step's chunks, built once
        for index, (kind, p) in enumerate(zip(c.layer_kinds(), self.layers, strict=True)):
            layer_pools = c.layer_pools(index)
            if wait is not None:
                for name, number in layer_pools.items():
                    wait(name, number)
            h = self.rms_norm(x, p["norm1"])
            if kind is LayerKind.SPARSE_LATENT:
                if step is None:
                    step = (bounds, inputs, decode_rows(inputs, bounds))
                layer = layer_pools["latent"]
                outs = sparse_latent_outputs(self, p, h, step, pools, layer, hot)
            else:
                outs = [
                    self._mix(kind, p, h[lo:hi], pools, layer_pools, inp)
                    for lo, hi, inp in zip(bounds, bounds[1:], inputs, strict=False)
                ]
            x = x + torch.cat(outs)
            h = self.rms_norm(x, p["norm2"])
            x = x + (torch.nn.functional.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        lasts = x[torch.tensor(bounds[1:], device=self.device) - 1]
        logits = self.rms_norm(lasts, torch.ones_like(lasts[0])) @ self.unembed
        return list(logits.to(torch.float32).cpu())

    def _mix(
        self,
        kind: LayerKind,
        p: dict[str, torch.Tensor],
        h: torch.Tensor,
        pools: Mapping[str, DevicePool],
        layer_pools: dict[str, int],
        inp: AttentionInputs,
    ) -> torch.Tensor:
        """The token-mixing half of a layer for one request (``layer_pools``: the layer's number
        in each pool it reads)."""
        if layer_group(kind) is not None:
            return compressed_layer(self, p, h, pools, layer_pools, inp, kind)
        pool_name = pool_of(kind)
        layer = layer_pools[pool_name]
        if kind is LayerKind.RECURRENT:
            return recurrent_layer(self, p, h, pools, layer, inp)
        if kind is LayerKind.LATENT:
            return latent_layer(self, p, h, pools, layer, inp)
        if kind is LayerKind.WINDOW:
            return window_layer(self, p, h, pools[pool_name], layer, inp)
        return attention_layer(self, p, h, pools[pool_name], layer, inp)
