"""The Llama / Qwen2 / Qwen3 family (dense GQA decoders) from a Hugging Face checkpoint, over
the paged ``kv`` pool of the ``dense`` preset.

Each layer: RMSNorm, q/k/v projections (biases for Qwen2, a per-head RMSNorm of q and k for
Qwen3), the half-split rotary embedding, the new tokens' K and V written to their slots, then
attention over the pool (:mod:`hicache.checkpoint.paged_attention`), the output projection, and
a SwiGLU MLP. Norms compute in float32 and round back as transformers' do, so a float32
checkpoint gives transformers' logits to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from hicache.checkpoint.hf_config import HFConfig
from hicache.checkpoint.paged_attention import cache_and_attend
from hicache.checkpoint.rope import RotaryTable, rotate_half_split
from hicache.checkpoint.step import (
    OneChunk,
    decoder_shapes,
    last_logits,
    rms_norm,
    step_inputs,
    swiglu,
    swiglu_shapes,
)
from hicache.checkpoint.weights import TensorFiles
from hicache.pools.device import DevicePool
from hicache.serving.model import ChunkInput, LayerWait
from hicache.serving.model_sparse import DecodePages
from hicache.serving.presets import ModelConfig

__all__ = ["DenseCheckpointModel", "dense_tensor_shapes"]


def dense_tensor_shapes(hf: HFConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape (transformers' names)."""
    layer = _layer_shapes(hf)
    return decoder_shapes(
        hf.vocab_size, hf.hidden, hf.tie_embeddings, "norm", hf.layers, lambda i: layer
    )


def _layer_shapes(hf: HFConfig) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hf.hidden,),
        "post_attention_layernorm.weight": (hf.hidden,),
        "self_attn.q_proj.weight": (hf.q_dim, hf.hidden),
        "self_attn.k_proj.weight": (hf.kv_dim, hf.hidden),
        "self_attn.v_proj.weight": (hf.kv_dim, hf.hidden),
        "self_attn.o_proj.weight": (hf.hidden, hf.q_dim),
    } | swiglu_shapes("mlp", hf.hidden, hf.intermediate)
    if hf.attention_bias:
        shapes |= {
            "self_attn.q_proj.bias": (hf.q_dim,),
            "self_attn.k_proj.bias": (hf.kv_dim,),
            "self_attn.v_proj.bias": (hf.kv_dim,),
        }
    if hf.qk_norm:
        shapes |= {
            "self_attn.q_norm.weight": (hf.head_dim,),
            "self_attn.k_norm.weight": (hf.head_dim,),
        }
    return shapes


class DenseCheckpointModel(OneChunk):
    """A loaded dense checkpoint; the serving engine calls :meth:`forward_batch` as it calls
    :class:`~hicache.serving.model.TinyTransformer`'s."""

    def __init__(
        self, hf: HFConfig, config: ModelConfig, files: TensorFiles, device: torch.device
    ) -> None:
        self.hf, self.config, self.device = hf, config, device
        self.dtype = config.kv_dtype.to_torch()
        names = {name: name for name in dense_tensor_shapes(hf)}
        weights = files.load(names, self.dtype, device)
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)
        self.norm = weights["model.norm.weight"]
        self.layers = [
            {name: weights[f"model.layers.{i}.{name}"] for name in _layer_shapes(hf)}
            for i in range(hf.layers)
        ]
        self.rotary = RotaryTable(hf.rope, hf.head_dim, device)

    @torch.no_grad()
    def forward_batch(
        self,
        chunks: Sequence[ChunkInput],
        pools: Mapping[str, DevicePool],
        wait: LayerWait | None = None,
        hot: DecodePages | None = None,
    ) -> list[torch.Tensor]:
        """One step over several requests' chunks; each chunk's last-token logits (vocab,)
        in float32 on the CPU."""
        layout, ids = step_inputs(chunks, hot, self.hf.vocab_size, self.device)
        cos, sin = self.rotary.at(layout.positions, self.dtype)
        pool = pools["kv"].buffer
        x = self.embed[ids]
        for index, layer in enumerate(self.layers):
            if wait is not None:
                wait("kv", index)
            q, k, v = self._qkv(
                layer, rms_norm(x, layer["input_layernorm.weight"], self.hf.rms_eps), cos, sin
            )
            mixed = cache_and_attend(layout, q, k, v, pool, index)
            x = x + F.linear(mixed, layer["self_attn.o_proj.weight"])
            h = rms_norm(x, layer["post_attention_layernorm.weight"], self.hf.rms_eps)
            x = x + swiglu(layer, "mlp", h)
        lasts = rms_norm(x[layout.last_rows], self.norm, self.hf.rms_eps)
        return last_logits(lasts, self.lm_head)

    def _qkv(
        self, layer: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hf, n = self.hf, h.shape[0]
        q = F.linear(h, layer["self_attn.q_proj.weight"], layer.get("self_attn.q_proj.bias"))
        k = F.linear(h, layer["self_attn.k_proj.weight"], layer.get("self_attn.k_proj.bias"))
        v = F.linear(h, layer["self_attn.v_proj.weight"], layer.get("self_attn.v_proj.bias"))
        q, k = q.view(n, hf.heads, hf.head_dim), k.view(n, hf.kv_heads, hf.head_dim)
        if hf.qk_norm:
            q = rms_norm(q, layer["self_attn.q_norm.weight"], self.hf.rms_eps)
            k = rms_norm(k, layer["self_attn.k_norm.weight"], self.hf.rms_eps)
        q, k = rotate_half_split(q, cos, sin), rotate_half_split(k, cos, sin)
        return q, k, v.view(n, hf.kv_heads, hf.head_dim)
