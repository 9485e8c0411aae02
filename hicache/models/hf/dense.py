"""The Llama / Qwen2 / Qwen3 family (dense GQA decoders) from a Hugging Face checkpoint, over
the paged ``kv`` pool of the ``dense`` preset.

Each layer: RMSNorm, q/k/v projections (biases for Qwen2, a per-head RMSNorm of q and k for
Qwen3), the half-split rotary embedding, the new tokens' K and V written to their slots, then
attention over the pool (:func:`~hicache.models.attention.gqa_attention`), the output
projection, and a SwiGLU MLP. Norms compute in float32 and round back as transformers' do, so a
float32 checkpoint gives transformers' logits to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.dtypes import DType
from hicache.models.attention import gqa_attention, gqa_shapes
from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.hf.config import RawConfig
from hicache.models.hf.family import CheckpointDecoder, GqaCheckpointConfig, ModelFamily
from hicache.models.hf.weights import Shapes, TensorFiles, decoder_shapes
from hicache.models.layers import swiglu_shapes
from hicache.models.rope import RopeConfig, RotaryTable
from hicache.models.step import Step

__all__ = ["DENSE", "DenseConfig", "DenseModel"]

LLAMA, QWEN2, QWEN3 = "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"


@dataclass(frozen=True, slots=True)
class DenseConfig(GqaCheckpointConfig):
    """The sizes of a dense GQA decoder (the Llama / Qwen2 / Qwen3 family)."""

    hidden: int
    intermediate: int
    rms_eps: float
    rope: RopeConfig
    attention_bias: bool  # q, k and v projections have biases (Qwen2; Llama's attention_bias)
    qk_norm: bool  # an RMSNorm over each head of q and k before the rotary embedding (Qwen3)
    max_positions: int


def parse(raw: RawConfig) -> DenseConfig:
    """The sizes of a Llama / Qwen2 / Qwen3 checkpoint."""
    arch = raw.architecture
    if arch not in (LLAMA, QWEN2, QWEN3):
        raise raw.fail(f"{arch} is not a dense GQA architecture")
    heads, hidden = raw.positive_int("num_attention_heads"), raw.positive_int("hidden_size")
    kv_heads = raw.positive_int("num_key_value_heads", heads)
    head_dim = raw.positive_int("head_dim", hidden // heads)
    if heads % kv_heads:
        raise raw.fail(f"{heads} attention heads are not a multiple of {kv_heads}")
    if head_dim % 2:
        raise raw.fail(f"head_dim {head_dim} must be even (rotary pairs)")
    _refuse_unsupported(raw)
    return DenseConfig(
        architecture=arch, vocab_size=raw.positive_int("vocab_size"), hidden=hidden,
        layers=raw.positive_int("num_hidden_layers"), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, intermediate=raw.positive_int("intermediate_size"),
        rms_eps=raw.number("rms_norm_eps", 1e-6, 0.0, 1.0), rope=raw.rope, dtype=raw.dtype,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == QWEN2 or bool(raw.get("attention_bias", False)),
        qk_norm=arch == QWEN3,
        max_positions=raw.positive_int("max_position_embeddings", 1 << 20),
    )  # fmt: skip


def _refuse_unsupported(raw: RawConfig) -> None:
    """Settings that would change the computation in ways this model does not implement."""
    raw.require("hidden_act", "silu")
    if raw.get("mlp_bias"):
        raise raw.fail("mlp_bias is not supported")
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        raise raw.fail(f"sliding-window layers ({raw.architecture}) are not supported")
    types = raw.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        raise raw.fail("layer_types other than 'full_attention' are not supported")
    if raw.get("pretraining_tp", 1) != 1:
        raise raw.fail("pretraining_tp other than 1 is not supported")


def tensor_shapes(cfg: DenseConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with its shape (transformers' names)."""
    layer = _layer_shapes(cfg)
    return decoder_shapes(
        cfg.vocab_size, cfg.hidden, cfg.tie_embeddings, "norm", cfg.layers, lambda i: layer
    )


def _layer_shapes(cfg: DenseConfig) -> Shapes:
    hidden = cfg.hidden
    norms = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    attention = gqa_shapes(cfg.head_sizes, hidden, biases=cfg.attention_bias, qk_norm=cfg.qk_norm)
    return norms | attention | swiglu_shapes("mlp", hidden, cfg.intermediate)


def model_config(cfg: DenseConfig, page_size: int, kv_dtype: DType) -> ModelConfig:
    """The ``dense`` preset: K and V of every layer in pool ``kv``."""
    return ModelConfig(
        preset=ModelPreset.DENSE, vocab_size=cfg.vocab_size, hidden=cfg.hidden,
        layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        page_size=page_size, kv_dtype=kv_dtype,
    )  # fmt: skip


class DenseModel(CheckpointDecoder):
    """A loaded dense checkpoint; the serving engine calls :meth:`forward_batch`."""

    def __init__(
        self, cfg: DenseConfig, config: ModelConfig, files: TensorFiles, device: torch.device
    ) -> None:
        super().__init__(cfg, config, files, device, tensor_shapes(cfg))
        self.rotary = RotaryTable.of(cfg.rope, cfg.head_dim, device)
        self.sizes = cfg.head_sizes

    def mix(self, index: int, h: torch.Tensor, step: Step) -> torch.Tensor:
        kv, weights = step.pools["kv"].buffer, self.layers[index]
        return gqa_attention(
            weights, h, self.sizes, step.rotation, self.eps, step.layout, kv, index
        )


DENSE = ModelFamily(parse, tensor_shapes, model_config, DenseModel)
