"""DeepSeek-V3 (multi-head latent attention and a mixture of experts) from a Hugging Face
checkpoint, over the ``latent`` pool of the ``mla`` preset, computed as transformers'
``DeepseekV3ForCausalLM`` computes it.

What a token caches per layer is its latent, as SGLang caches it: ``kv_a_layernorm`` of the
compressed KV (``kv_lora_rank`` dims) followed by its rotary key, already rotated
(``qk_rope_head_dim`` dims). Prefill chunks attend in the naive form (each context token's
per-head K and V expanded from its latent by ``kv_b_proj``, as transformers does); decode
tokens in the absorbed form (the query taken into the latent space, so a step reads the
context's latents and never expands them), both through torch's SDPA with transformers'
softmax scale. The feed-forward blocks are :mod:`hicache.checkpoint.deepseek_moe`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.checkpoint.deepseek_moe import (
    ROUTER_TENSORS,
    MoeConfig,
    feed_forward,
    mlp_shapes,
    moe_config,
)
from hicache.checkpoint.hf_config import Architecture, RawConfig, RopeConfig
from hicache.checkpoint.paged_attention import StepLayout
from hicache.checkpoint.rope import rotate_half_split
from hicache.checkpoint.step import (
    OneChunk,
    decoder_shapes,
    last_logits,
    rms_norm,
    step_inputs,
)
from hicache.checkpoint.weights import TensorFiles
from hicache.checkpoint.yarn import ScaledRotary, YarnRope, rope_and_scale
from hicache.dtypes import DType
from hicache.pools.device import DevicePool, take_rows
from hicache.serving.model import ChunkInput, LayerWait
from hicache.serving.model_sparse import DecodePages
from hicache.serving.presets import ModelConfig, ModelPreset

__all__ = [
    "DeepseekV3Config",
    "DeepseekV3Model",
    "deepseek_config",
    "deepseek_model_config",
    "deepseek_tensor_shapes",
]

# transformers' DeepseekV3Config defaults: a config.json without the field reads as these.
_SIZES = {
    "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
}  # fmt: skip
_INNER_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default


@dataclass(frozen=True, slots=True)
class DeepseekV3Config:
    """The sizes of a DeepSeek-V3 checkpoint (transformers' ``DeepseekV3Config``)."""

    architecture: Architecture
    dtype: torch.dtype  # the checkpoint's
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    q_lora_rank: int | None  # None: the query is projected directly (``q_proj``)
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    rms_eps: float
    rope: RopeConfig | YarnRope
    rope_interleave: bool  # the checkpoint's rotary dims are in interleaved pairs
    softmax_scale: float  # includes yarn's mscale when the rope is scaled
    attention_bias: bool  # q_a_proj, kv_a_proj_with_mqa and o_proj have biases
    tie_embeddings: bool
    moe: MoeConfig

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim


def deepseek_config(raw: RawConfig) -> DeepseekV3Config:
    """The sizes of a DeepSeek-V3 checkpoint, with transformers' defaults for absent fields
    (it reads the file the same way) and everything this model does not compute refused."""
    if raw.architecture is not Architecture.DEEPSEEK_V3:
        raise raw.fail(f"{raw.architecture.value} is not DeepSeek-V3")
    size = {name: raw.positive_int(name, default) for name, default in _SIZES.items()}
    _refuse_unsupported(raw, size)
    nope, rot, hidden = size["qk_nope_head_dim"], size["qk_rope_head_dim"], size["hidden_size"]
    q_lora = None if raw.get("q_lora_rank", 1536) is None else raw.positive_int("q_lora_rank")
    rope, softmax_scale = rope_and_scale(raw, nope + rot)
    return DeepseekV3Config(
        architecture=raw.architecture, dtype=raw.dtype, vocab_size=size["vocab_size"],
        hidden=hidden, layers=size["num_hidden_layers"], heads=size["num_attention_heads"],
        q_lora_rank=q_lora, kv_lora_rank=size["kv_lora_rank"], qk_nope_dim=nope,
        qk_rope_dim=rot, v_dim=size["v_head_dim"],
        rms_eps=raw.number("rms_norm_eps", 1e-6, 0.0, 1.0), rope=rope,
        rope_interleave=raw.flag("rope_interleave", True), softmax_scale=softmax_scale,
        attention_bias=raw.flag("attention_bias", False),
        tie_embeddings=raw.flag("tie_word_embeddings", False), moe=moe_config(raw, hidden),
    )  # fmt: skip


def _refuse_unsupported(raw: RawConfig, size: dict[str, int]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise raw.fail(f"hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("quantization_config") is not None:
        raise raw.fail("quantized checkpoints (quantization_config) are not supported")
    if size["qk_rope_head_dim"] % 2:
        raise raw.fail(f"qk_rope_head_dim {size['qk_rope_head_dim']} must be even (rotary pairs)")
    # Every head's K and V come from the latent: transformers reads num_key_value_heads only to
    # repeat them, which breaks its attention when there are fewer (its default, 128, exceeds
    # a tiny model's heads, and its SDPA path then ignores the field).
    kv_heads, heads = raw.get("num_key_value_heads"), size["num_attention_heads"]
    if isinstance(kv_heads, int) and kv_heads < heads:
        raise raw.fail(f"num_key_value_heads {kv_heads} below num_attention_heads is not supported")


def deepseek_tensor_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape (transformers' names; the routed
    experts one by one, as ``save_pretrained`` writes them)."""
    return decoder_shapes(
        cfg.vocab_size, cfg.hidden, cfg.tie_embeddings, "norm", cfg.layers,
        lambda i: _layer_shapes(cfg, i),
    )  # fmt: skip


def _layer_shapes(cfg: DeepseekV3Config, layer: int) -> dict[str, tuple[int, ...]]:
    h, heads, attn = cfg.hidden, cfg.heads, "self_attn"
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        f"{attn}.kv_a_proj_with_mqa.weight": (cfg.latent_dim, h),
        f"{attn}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        f"{attn}.kv_b_proj.weight": (heads * (cfg.qk_nope_dim + cfg.v_dim), cfg.kv_lora_rank),
        f"{attn}.o_proj.weight": (h, heads * cfg.v_dim),
    }
    if cfg.q_lora_rank is None:
        shapes[f"{attn}.q_proj.weight"] = (heads * cfg.qk_dim, h)
    else:
        shapes |= {
            f"{attn}.q_a_proj.weight": (cfg.q_lora_rank, h),
            f"{attn}.q_a_layernorm.weight": (cfg.q_lora_rank,),
            f"{attn}.q_b_proj.weight": (heads * cfg.qk_dim, cfg.q_lora_rank),
        }
    if cfg.attention_bias:
        shapes |= {
            f"{attn}.kv_a_proj_with_mqa.bias": (cfg.latent_dim,),
            f"{attn}.o_proj.bias": (h,),
        }
        if cfg.q_lora_rank is not None:
            shapes[f"{attn}.q_a_proj.bias"] = (cfg.q_lora_rank,)
    return shapes | mlp_shapes(cfg.moe, layer)


def deepseek_model_config(cfg: DeepseekV3Config, page_size: int, kv_dtype: DType) -> ModelConfig:
    """The ``mla`` preset: one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per
    layer, shared by every head (hence one KV head); ``head_dim`` is the rotary dim, as
    transformers' config sets it (always even, where the QK head dim need not be)."""
    return ModelConfig(
        preset=ModelPreset.MLA, vocab_size=cfg.vocab_size, hidden=cfg.hidden, layers=cfg.layers,
        heads=cfg.heads, kv_heads=1, head_dim=cfg.qk_rope_dim, page_size=page_size,
        latent_dim=cfg.latent_dim, kv_dtype=kv_dtype,
    )  # fmt: skip


class DeepseekV3Model(OneChunk):
    """A loaded DeepSeek-V3 checkpoint; the serving engine calls :meth:`forward_batch` as it
    calls :class:`~hicache.checkpoint.dense.DenseCheckpointModel`'s."""

    def __init__(
        self, cfg: DeepseekV3Config, config: ModelConfig, files: TensorFiles, device: torch.device
    ) -> None:
        self.cfg, self.config, self.device = cfg, config, device
        self.dtype = config.kv_dtype.to_torch()
        shapes = deepseek_tensor_shapes(cfg)
        router = {n for n in shapes if n.split(".", 3)[-1] in ROUTER_TENSORS}
        weights = files.load({n: n for n in shapes if n not in router}, self.dtype, device)
        weights |= files.load({n: n for n in router}, torch.float32, device)
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)
        self.norm = weights["model.norm.weight"]
        self.layers = [
            {name: weights[f"model.layers.{i}.{name}"] for name in _layer_shapes(cfg, i)}
            for i in range(cfg.layers)
        ]
        self.rotary = ScaledRotary(cfg.rope, cfg.qk_rope_dim, device)

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
        layout, ids = step_inputs(chunks, hot, self.cfg.vocab_size, self.device)
        rotary = self.rotary.at(layout.positions, self.dtype)
        latents = pools["latent"].buffer[0, :, :, 0]  # (layers, slots, latent_dim)
        eps, x = self.cfg.rms_eps, self.embed[ids]
        for index, layer in enumerate(self.layers):
            if wait is not None:
                wait("latent", index)
            h = rms_norm(x, layer["input_layernorm.weight"], eps)
            x = x + self._attention(layer, h, rotary, latents[index], layout)
            h = rms_norm(x, layer["post_attention_layernorm.weight"], eps)
            x = x + feed_forward(self.cfg.moe, layer, h)
        lasts = rms_norm(x[layout.last_rows], self.norm, eps)
        return last_logits(lasts, self.lm_head)

    def _rotate(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` (n, heads, rope dim) rotated. An interleaved checkpoint's pairs are (0, 1),
        (2, 3), ...; transformers returns them de-interleaved (evens, then odds), which is
        the half-split rotation of the de-interleaved input, bit for bit."""
        if self.cfg.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return rotate_half_split(x, *rotary)

    def _attention(
        self,
        layer: Mapping[str, torch.Tensor],
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        latents: torch.Tensor,
        layout: StepLayout,
    ) -> torch.Tensor:
        """The step's new latents written to their slots of ``latents`` (slots, latent_dim),
        then each token's attention over its context read back from there."""
        cfg, n = self.cfg, h.shape[0]
        q = self._query(layer, h).view(n, cfg.heads, cfg.qk_dim)
        q_nope, q_rot = torch.split(q, [cfg.qk_nope_dim, cfg.qk_rope_dim], dim=-1)
        q_rot = self._rotate(q_rot, rotary)
        attn = "self_attn.kv_a_proj_with_mqa"
        kv = F.linear(h, layer[f"{attn}.weight"], layer.get(f"{attn}.bias"))
        compressed, k_rot = torch.split(kv, [cfg.kv_lora_rank, cfg.qk_rope_dim], dim=-1)
        compressed = rms_norm(compressed, layer["self_attn.kv_a_layernorm.weight"], _INNER_EPS)
        k_rot = self._rotate(k_rot[:, None], rotary)[:, 0]
        latents[layout.new_slots] = torch.cat((compressed, k_rot), dim=-1).to(latents.dtype)
        out = h.new_empty(n, cfg.heads * cfg.v_dim)
        kv_b = layer["self_attn.kv_b_proj.weight"]
        if len(layout.decode_rows):
            rows = layout.decode_rows
            out[rows] = self._absorbed(kv_b, q_nope[rows], q_rot[rows], latents, layout)
        for chunk in layout.prefills:
            full = torch.cat((q_nope[chunk.rows], q_rot[chunk.rows]), dim=-1)
            context = latents.index_select(0, chunk.slots)
            out[chunk.rows] = self._expanded(kv_b, full, context, chunk.mask)
        return F.linear(out, layer["self_attn.o_proj.weight"], layer.get("self_attn.o_proj.bias"))

    def _query(self, layer: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return F.linear(h, layer["self_attn.q_proj.weight"])
        low = F.linear(h, layer["self_attn.q_a_proj.weight"], layer.get("self_attn.q_a_proj.bias"))
        low = rms_norm(low, layer["self_attn.q_a_layernorm.weight"], _INNER_EPS)
        return F.linear(low, layer["self_attn.q_b_proj.weight"])

    def _expanded(
        self, kv_b: torch.Tensor, q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """A prefill chunk's queries ``q`` (n, H, qk dim) over its ``context`` latents
        (T, latent_dim), each expanded to per-head K and V as transformers does: (n, H * v)."""
        cfg, t = self.cfg, context.shape[0]
        nope, rot = torch.split(context.to(self.dtype), [cfg.kv_lora_rank, cfg.qk_rope_dim], dim=-1)
        kv = F.linear(nope, kv_b).view(t, cfg.heads, cfg.qk_nope_dim + cfg.v_dim)
        k_nope, v = torch.split(kv, [cfg.qk_nope_dim, cfg.v_dim], dim=-1)
        k = torch.cat((k_nope, rot[:, None].expand(t, cfg.heads, cfg.qk_rope_dim)), dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask[None, None], scale=cfg.softmax_scale,
        )  # fmt: skip
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)

    def _absorbed(
        self,
        kv_b: torch.Tensor,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latents: torch.Tensor,
        layout: StepLayout,
    ) -> torch.Tensor:
        """The decode rows' attention in the latent space: ``kv_b_proj``'s key half folded into
        the queries (B, H, nope), so the context's latents are the one shared K (and their
        compressed part the V) of every head, then its value half applied: (B, H * v)."""
        cfg = self.cfg
        kv_b = kv_b.view(cfg.heads, cfg.qk_nope_dim + cfg.v_dim, cfg.kv_lora_rank)
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, kv_b[:, : cfg.qk_nope_dim])
        q = torch.cat((q_latent, q_rot), dim=-1)[:, None]  # the heads on the query axis
        context = take_rows(latents, layout.decode_slots).to(self.dtype)[:, None]  # (B, 1, T, L)
        out = F.scaled_dot_product_attention(
            q, context, context[..., : cfg.kv_lora_rank], attn_mask=layout.decode_mask,
            scale=cfg.softmax_scale,
        )  # fmt: skip
        mixed = torch.einsum("bhr,hvr->bhv", out[:, 0], kv_b[:, cfg.qk_nope_dim :])
        return mixed.reshape(q.shape[0], -1)
