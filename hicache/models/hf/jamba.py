"""Jamba (``JambaForCausalLM``) from a Hugging Face checkpoint, over the ``hybrid`` preset's
pools, computed as transformers' implementation computes it.

Layer ``i`` mixes tokens with attention when ``i % attn_layer_period == attn_layer_offset``
(GQA with no position embedding at all: the Mamba layers carry position; K and V in pool
``kv``, attention through :func:`~hicache.models.attention.gqa_attention`), else with a Mamba
mixer whose state lives in pools ``conv`` and ``ssm`` (:mod:`hicache.models.mamba`). Its
feed-forward block is a mixture of experts when ``num_experts > 1`` and
``i % expert_layer_period == expert_layer_offset``, else a SwiGLU MLP. The router is a softmax
over the experts in float32 whose top ``num_experts_per_tok`` probabilities weigh the chosen
experts as they are, not renormalized (as transformers' ``JambaTopKRouter`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.dtypes import DType
from hicache.models.attention import gqa_attention, gqa_shapes
from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.hf.config import RawConfig
from hicache.models.hf.family import CheckpointDecoder, GqaCheckpointConfig, ModelFamily
from hicache.models.hf.weights import Shapes, TensorFiles, decoder_shapes
from hicache.models.layers import routed_experts, swiglu, swiglu_shapes
from hicache.models.mamba import MambaSizes, mamba_layer, mamba_shapes
from hicache.models.step import Step

__all__ = ["JAMBA", "JambaConfig", "JambaModel"]

# transformers' JambaConfig defaults: a config.json without the field reads as these.
_SIZES = {
    "vocab_size": 65536, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_experts": 16,
    "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
}  # fmt: skip
_PERIODS = {"attn_layer": (8, 4), "expert_layer": (2, 1)}  # (period, offset) defaults
_STATE_INTERVAL = 128  # tokens between state snapshots, rounded up to whole pages


@dataclass(frozen=True, slots=True)
class JambaConfig(GqaCheckpointConfig):
    """The sizes and layer pattern of a Jamba checkpoint."""

    intermediate: int  # each MLP's and each expert's
    attn_period: int
    attn_offset: int
    expert_period: int
    expert_offset: int
    experts: int  # num_experts (1: every layer has a plain MLP)
    per_token: int  # num_experts_per_tok
    mamba: MambaSizes

    @property
    def hidden(self) -> int:
        return self.mamba.hidden

    @property
    def rms_eps(self) -> float:
        return self.mamba.rms_eps

    def is_attention(self, layer: int) -> bool:
        return layer % self.attn_period == self.attn_offset

    def is_moe(self, layer: int) -> bool:
        return self.experts > 1 and layer % self.expert_period == self.expert_offset


def parse(raw: RawConfig) -> JambaConfig:
    """The fields of a Jamba ``config.json`` (transformers' defaults where absent), with what
    this model does not compute refused by name."""
    size = {name: raw.positive_int(name, default) for name, default in _SIZES.items()}
    hidden, heads = size["hidden_size"], size["num_attention_heads"]
    # transformers reads an explicit null as one KV head per attention head
    kv_default = heads if raw.get("num_key_value_heads", 8) is None else 8
    kv_heads = raw.positive_int("num_key_value_heads", kv_default)
    if heads % kv_heads:
        raise raw.fail(f"{heads} attention heads are not a multiple of {kv_heads}")
    # one expert means a plain MLP in every layer: no router, whatever num_experts_per_tok says
    if 1 < size["num_experts"] < size["num_experts_per_tok"]:
        raise raw.fail(
            f"num_experts_per_tok {size['num_experts_per_tok']} exceeds num_experts "
            f"{size['num_experts']}"
        )
    if size["mamba_d_conv"] < 2:
        raise raw.fail(f"mamba_d_conv {size['mamba_d_conv']} must be at least 2")
    _refuse_unsupported(raw)
    attn, expert = _pattern(raw, "attn_layer"), _pattern(raw, "expert_layer")
    _check_both_kinds(raw, size["num_hidden_layers"], *attn)
    mamba = MambaSizes(
        hidden=hidden, inner=size["mamba_expand"] * hidden, d_state=size["mamba_d_state"],
        d_conv=size["mamba_d_conv"], dt_rank=_dt_rank(raw, hidden),
        conv_bias=raw.flag("mamba_conv_bias", True),
        proj_bias=raw.flag("mamba_proj_bias", False),
        rms_eps=raw.number("rms_norm_eps", 1e-6, 0.0, 1.0),
    )  # fmt: skip
    return JambaConfig(
        architecture=raw.architecture, dtype=raw.dtype, vocab_size=size["vocab_size"],
        layers=size["num_hidden_layers"], heads=heads, kv_heads=kv_heads,
        head_dim=raw.positive_int("head_dim", hidden // heads),
        intermediate=size["intermediate_size"], attn_period=attn[0], attn_offset=attn[1],
        expert_period=expert[0], expert_offset=expert[1], experts=size["num_experts"],
        per_token=size["num_experts_per_tok"], mamba=mamba,
        tie_embeddings=raw.flag("tie_word_embeddings", False),
    )  # fmt: skip


def _refuse_unsupported(raw: RawConfig) -> None:
    raw.require("hidden_act", "silu")
    # transformers 5 ignores it (4.x used it in flash attention only); a window the model was
    # trained with would change what attention sees, so it is refused rather than dropped
    if raw.get("sliding_window") is not None:
        raise raw.fail(f"sliding_window {raw.get('sliding_window')!r} is not supported")


def _pattern(raw: RawConfig, prefix: str) -> tuple[int, int]:
    """``{prefix}_period`` and ``{prefix}_offset``, the offset below the period."""
    period_default, offset_default = _PERIODS[prefix]
    period = raw.positive_int(f"{prefix}_period", period_default)
    offset = raw.get(f"{prefix}_offset", offset_default)
    if type(offset) is not int or not 0 <= offset < period:
        raise raw.fail(
            f"'{prefix}_offset' must be an int in [0, {prefix}_period {period}), got {offset!r}"
        )
    return period, offset


def _check_both_kinds(raw: RawConfig, layers: int, period: int, offset: int) -> None:
    """The hybrid preset anchors its cache on attention layers and keeps Mamba state beside
    them, so a pattern without one of the kinds is refused."""
    attention = sum(1 for i in range(layers) if i % period == offset)
    if attention == 0 or attention == layers:
        kind = "attention" if attention == 0 else "Mamba"
        raise raw.fail(
            f"attn_layer_period {period} with attn_layer_offset {offset} over {layers} layers "
            f"leaves no {kind} layer (the hybrid pools need both)"
        )


def _dt_rank(raw: RawConfig, hidden: int) -> int:
    rank = raw.get("mamba_dt_rank", "auto")
    if rank == "auto":
        return math.ceil(hidden / 16)
    if type(rank) is not int or rank < 1:
        raise raw.fail(f"'mamba_dt_rank' must be 'auto' or a positive int, got {rank!r}")
    return rank


def tensor_shapes(cfg: JambaConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with its shape (transformers' names)."""
    return decoder_shapes(
        cfg.vocab_size, cfg.hidden, cfg.tie_embeddings, "final_layernorm", cfg.layers,
        lambda i: _layer(cfg, i),
    )  # fmt: skip


def _layer(cfg: JambaConfig, layer: int) -> Shapes:
    """Layer ``layer``'s tensors, named below ``model.layers.{layer}.``."""
    hidden = cfg.hidden
    shapes: Shapes = {
        "input_layernorm.weight": (hidden,),
        "pre_ff_layernorm.weight": (hidden,),
    }
    if cfg.is_attention(layer):
        shapes |= gqa_shapes(cfg.head_sizes, hidden)
    else:
        shapes |= mamba_shapes(cfg.mamba)
    if not cfg.is_moe(layer):
        return shapes | swiglu_shapes("feed_forward", hidden, cfg.intermediate)
    shapes["feed_forward.router.weight"] = (cfg.experts, hidden)
    for expert in range(cfg.experts):
        shapes |= swiglu_shapes(f"feed_forward.experts.{expert}", hidden, cfg.intermediate)
    return shapes


def model_config(cfg: JambaConfig, page_size: int, kv_dtype: DType) -> ModelConfig:
    """The hybrid preset: ``kv`` for the attention layers, ``conv`` and ``ssm`` for the Mamba
    layers' state, a snapshot every :data:`_STATE_INTERVAL` tokens rounded up to whole pages."""
    m = cfg.mamba
    return ModelConfig(
        preset=ModelPreset.HYBRID, vocab_size=cfg.vocab_size, hidden=cfg.hidden,
        layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        page_size=page_size, kv_dtype=kv_dtype, state_dim=m.d_state, conv_kernel=m.d_conv,
        state_inner=m.inner, state_interval=-(-_STATE_INTERVAL // page_size) * page_size,
        attention_period=cfg.attn_period, attention_offset=cfg.attn_offset,
    )  # fmt: skip


class JambaModel(CheckpointDecoder):
    """A loaded Jamba checkpoint; the serving engine calls :meth:`forward_batch`: attention
    batched over the step, each request's Mamba state carried through its own chunk."""

    norm_names = ("input_layernorm.weight", "pre_ff_layernorm.weight")
    final_norm = "final_layernorm"

    def __init__(
        self, cfg: JambaConfig, config: ModelConfig, files: TensorFiles, device: torch.device
    ) -> None:
        super().__init__(cfg, config, files, device, tensor_shapes(cfg))
        self.sizes = cfg.head_sizes

    def mix(self, index: int, h: torch.Tensor, step: Step) -> torch.Tensor:
        numbers, weights = self.pool_numbers[index], self.layers[index]
        if "kv" not in numbers:
            return mamba_layer(self.cfg.mamba, weights, h, step, numbers["conv"])
        kv = step.pools["kv"].buffer  # GQA with no position embedding
        return gqa_attention(weights, h, self.sizes, None, self.eps, step.layout, kv, numbers["kv"])

    def feed_forward(self, index: int, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP, or its mixture of experts: each chosen expert runs on its tokens
        only, the experts in index order, weighted by the softmax probability that chose it."""
        layer = self.layers[index]
        if "feed_forward.router.weight" not in layer:
            return swiglu(layer, "feed_forward", h)
        router = F.linear(h, layer["feed_forward.router.weight"])
        probs = F.softmax(router, dim=-1, dtype=torch.float)
        top_weights, top_experts = torch.topk(probs, self.cfg.per_token, dim=-1)
        weights = top_weights.to(h.dtype)
        return routed_experts(layer, "feed_forward.experts", h, top_experts, weights)


JAMBA = ModelFamily(parse, tensor_shapes, model_config, JambaModel)
