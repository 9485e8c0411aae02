"""DeepSeek-V3 (multi-head latent attention and a mixture of experts) from a Hugging Face
checkpoint, over the ``latent`` pool of the ``mla`` preset, computed as transformers'
``DeepseekV3ForCausalLM`` computes it: multi-head latent attention
(:func:`~hicache.models.latent.mla_attention`: what a token caches per layer is its latent, as
SGLang caches it) with the rotary embedding of its checkpoint (yarn where it is scaled), and the
feed-forward blocks of :mod:`hicache.models.hf.deepseek_moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.dtypes import DType
from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.hf.config import RawConfig, rope_and_scale
from hicache.models.hf.deepseek_moe import (
    ROUTER_TENSORS,
    MoeConfig,
    feed_forward,
    mlp_shapes,
    moe_config,
)
from hicache.models.hf.family import CheckpointConfig, CheckpointDecoder, ModelFamily
from hicache.models.hf.weights import Shapes, TensorFiles, decoder_shapes
from hicache.models.latent import MlaSizes, mla_attention
from hicache.models.rope import Pairing, RopeConfig, RotaryTable, YarnRope
from hicache.models.step import Step

__all__ = ["DEEPSEEK_V3", "DeepseekV3Config", "DeepseekV3Model"]

# transformers' DeepseekV3Config defaults: a config.json without the field reads as these.
_SIZES = {
    "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class DeepseekV3Config(CheckpointConfig):
    """The sizes of a DeepSeek-V3 checkpoint (transformers' ``DeepseekV3Config``)."""

    hidden: int
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
    moe: MoeConfig

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim


def parse(raw: RawConfig) -> DeepseekV3Config:
    """The sizes of a DeepSeek-V3 checkpoint, with transformers' defaults for absent fields
    (it reads the file the same way) and everything this model does not compute refused."""
    if raw.architecture != "DeepseekV3ForCausalLM":
        raise raw.fail(f"{raw.architecture} is not DeepSeek-V3")
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
    raw.require("hidden_act", "silu")
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


def tensor_shapes(cfg: DeepseekV3Config) -> Shapes:
    """Every tensor the checkpoint must hold, with its shape (transformers' names; the routed
    experts one by one, as ``save_pretrained`` writes them)."""
    return decoder_shapes(
        cfg.vocab_size, cfg.hidden, cfg.tie_embeddings, "norm", cfg.layers,
        lambda i: _layer_shapes(cfg, i),
    )  # fmt: skip


def _layer_shapes(cfg: DeepseekV3Config, layer: int) -> Shapes:
    h, heads, attn = cfg.hidden, cfg.heads, "self_attn"
    shapes: Shapes = {
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


def model_config(cfg: DeepseekV3Config, page_size: int, kv_dtype: DType) -> ModelConfig:
    """The ``mla`` preset: one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per
    layer, shared by every head (hence one KV head); ``head_dim`` is the rotary dim, as
    transformers' config sets it (always even, where the QK head dim need not be)."""
    return ModelConfig(
        preset=ModelPreset.MLA, vocab_size=cfg.vocab_size, hidden=cfg.hidden, layers=cfg.layers,
        heads=cfg.heads, kv_heads=1, head_dim=cfg.qk_rope_dim, page_size=page_size,
        latent_dim=cfg.latent_dim, kv_dtype=kv_dtype,
    )  # fmt: skip


class DeepseekV3Model(CheckpointDecoder):
    """A loaded DeepSeek-V3 checkpoint; the serving engine calls :meth:`forward_batch`."""

    float32 = ROUTER_TENSORS

    def __init__(
        self, cfg: DeepseekV3Config, config: ModelConfig, files: TensorFiles, device: torch.device
    ) -> None:
        super().__init__(cfg, config, files, device, tensor_shapes(cfg))
        self.rotary = RotaryTable.of(cfg.rope, cfg.qk_rope_dim, device)
        # An interleaved checkpoint's pairs are (0, 1), (2, 3), ...; transformers returns them
        # de-interleaved (evens, then odds): the half-split rotation of the de-interleaved input.
        self.pairing = Pairing.DEINTERLEAVED if cfg.rope_interleave else Pairing.HALF_SPLIT
        self.mla = MlaSizes(
            cfg.heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.qk_rope_dim,
            cfg.v_dim, cfg.softmax_scale,
        )  # fmt: skip

    def mix(self, index: int, h: torch.Tensor, step: Step) -> torch.Tensor:
        latents = step.pools["latent"].buffer[0, index, :, 0]  # (slots, latent_dim)
        return mla_attention(self.mla, self.layers[index], h, step, latents)

    def feed_forward(self, index: int, h: torch.Tensor) -> torch.Tensor:
        return feed_forward(self.cfg.moe, self.layers[index], h)


def _past_last_layer(parsed: DeepseekV3Config, name: str) -> bool:
    """``model.layers.N.*`` with N past the decoder's layers: DeepSeek's multi-token-prediction
    modules, which real checkpoints hold and greedy decoding does not run."""
    parts = name.split(".")
    return (
        parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= parsed.layers
    )


DEEPSEEK_V3 = ModelFamily(parse, tensor_shapes, model_config, DeepseekV3Model, _past_last_layer)
