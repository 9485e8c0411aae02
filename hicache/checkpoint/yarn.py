"""Rotary embeddings of DeepSeek-V3 checkpoints: transformers' ``yarn`` scaling (DeepSeek-V3's
long-context setting) beside the kinds :mod:`hicache.checkpoint.rope` computes, and the softmax
scale a scaled rope implies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hicache.checkpoint.hf_config import RawConfig, RopeConfig
from hicache.checkpoint.rope import inverse_frequencies

__all__ = ["ScaledRotary", "YarnRope", "rope_and_scale"]

_ROPE_KINDS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class YarnRope:
    """transformers' ``yarn`` rotary scaling (DeepSeek-V3's long-context setting)."""

    theta: float
    factor: float
    original_max_positions: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float  # cos and sin are multiplied by it


def rope_and_scale(raw: RawConfig, qk_dim: int) -> tuple[RopeConfig | YarnRope, float]:
    """The rotary embedding, and the softmax scale it implies: transformers'
    ``yarn_apply_mscale`` sharpens the softmax of any scaled rope that names ``mscale_all_dim``
    by that mscale squared."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise raw.fail(f"rope parameters must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise raw.fail(f"rope type {kind!r} is not supported ({', '.join(_ROPE_KINDS)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise raw.fail("partial_rotary_factor is not supported")
    rope = _yarn(raw, params) if kind == "yarn" else raw.rope
    scale = qk_dim ** (-0.5)
    mscale_all_dim = _number(raw, params, "mscale_all_dim")
    if kind != "default" and mscale_all_dim:
        mscale = _mscale(rope.factor, mscale_all_dim)
        scale = scale * mscale * mscale
    return rope, scale


def _yarn(raw: RawConfig, params: dict[str, Any]) -> YarnRope:
    """transformers' defaults: the original length is ``max_position_embeddings`` and, with no
    ``factor``, the factor is the extension the two lengths state."""
    longest = raw.positive_int("max_position_embeddings", 4096)
    original = params.get("original_max_position_embeddings", longest)
    if type(original) is not int or original < 1:
        raise raw.fail(f"rope original_max_position_embeddings {original!r} must be a positive int")
    theta = _positive(raw, "rope_theta", params.get("rope_theta", raw.get("rope_theta", 1e4)))
    factor = params.get("factor")
    factor = _positive(raw, "factor", longest / original if factor is None else factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise raw.fail(f"rope truncate must be true or false, got {truncate!r}")
    return YarnRope(
        theta=theta, factor=factor, original_max_positions=original,
        beta_fast=_positive(raw, "beta_fast", params.get("beta_fast") or 32),
        beta_slow=_positive(raw, "beta_slow", params.get("beta_slow") or 1),
        truncate=truncate, attention_factor=_yarn_attention_factor(raw, params, factor),
    )  # fmt: skip


def _yarn_attention_factor(raw: RawConfig, params: dict[str, Any], factor: float) -> float:
    """What cos and sin are multiplied by: ``attention_factor``, else yarn's from the mscales."""
    given = params.get("attention_factor")
    if given is not None:
        return _positive(raw, "attention_factor", given)
    mscale, all_dim = (_number(raw, params, n) for n in ("mscale", "mscale_all_dim"))
    if mscale and all_dim:
        return _mscale(factor, mscale) / _mscale(factor, all_dim)
    return _mscale(factor)


def _number(raw: RawConfig, params: dict[str, Any], name: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise raw.fail(f"rope {name} must be a number, got {value!r}")
    return float(value)


def _positive(raw: RawConfig, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise raw.fail(f"rope {name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise raw.fail(f"rope {name} must be finite, got {value!r}")
    return float(value)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class ScaledRotary:
    """cos and sin as transformers' ``DeepseekV3RotaryEmbedding`` computes them: float32
    angles of ``qk_rope_head_dim`` dims, yarn's attention factor applied before the cast."""

    def __init__(self, rope: RopeConfig | YarnRope, dim: int, device: torch.device) -> None:
        if isinstance(rope, YarnRope):
            inv, self.scaling = _yarn_frequencies(rope, dim), rope.attention_factor
        else:
            inv, self.scaling = inverse_frequencies(rope, dim), 1.0
        self.inv_freq = inv.to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)


def _yarn_frequencies(rope: YarnRope, dim: int) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters``: the slow pairs interpolated (divided by
    ``factor``), the fast ones kept, a linear ramp between."""
    powers = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    low, high = (_correction_dim(rope, dim, r) for r in (rope.beta_fast, rope.beta_slow))
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    return (1.0 / (rope.factor * powers)) * (1 - kept) + (1.0 / powers) * kept


def _correction_dim(rope: YarnRope, dim: int, rotations: float) -> float:
    turns = rope.original_max_positions / (rotations * 2 * math.pi)
    return (dim * math.log(turns)) / (2 * math.log(rope.theta))
