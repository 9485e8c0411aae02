"""A Hugging Face ``config.json`` read into what the serving model needs: the architecture,
its sizes, and the rotary embedding, with every unsupported or inconsistent setting refused by
name before anything is allocated.

Both spellings transformers has written are read: ``rope_parameters`` (5.x) and ``rope_theta``
with ``rope_scaling`` (4.x); ``dtype`` and ``torch_dtype``.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hicache.errors import CheckpointError

__all__ = [
    "Architecture",
    "HFConfig",
    "RawConfig",
    "RopeConfig",
    "RopeKind",
    "dense_config",
    "read_config",
]


class Architecture(enum.Enum):
    """The ``architectures[0]`` names this package serves."""

    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"
    DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
    JAMBA = "JambaForCausalLM"


DENSE_ARCHITECTURES = (Architecture.LLAMA, Architecture.QWEN2, Architecture.QWEN3)


class RopeKind(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"  # positions divided by ``factor``
    LLAMA3 = "llama3"  # Llama 3.1's long-context frequency bands


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 8192  # llama3


@dataclass(frozen=True, slots=True)
class HFConfig:
    """The sizes of a dense GQA decoder (the Llama / Qwen2 / Qwen3 family)."""

    architecture: Architecture
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope: RopeConfig
    dtype: torch.dtype  # the checkpoint's
    tie_embeddings: bool
    attention_bias: bool  # q, k and v projections have biases (Qwen2; Llama's attention_bias)
    qk_norm: bool  # an RMSNorm over each head of q and k before the rotary embedding (Qwen3)
    max_positions: int

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RawConfig:
    """A ``config.json`` as read, with typed getters whose errors name the file and field."""

    path: Path
    architecture: Architecture
    values: dict[str, Any]

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def positive_int(self, name: str, default: int | None = None) -> int:
        value = self.values.get(name, default)
        if value is None and default is not None:
            value = default
        if type(value) is not int or value < 1:
            raise CheckpointError(f"{self.path}: {name!r} must be a positive int, got {value!r}")
        return value

    def number(self, name: str, default: float, low: float, high: float) -> float:
        """A number in the open interval (low, high)."""
        value = self.values.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
            raise CheckpointError(
                f"{self.path}: {name!r} must be in ({low}, {high}), got {value!r}"
            )
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self.values.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(f"{name!r} must be true or false, got {value!r}")
        return value

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {problem}")

    @property
    def dtype(self) -> torch.dtype:
        name = self.values.get("dtype", self.values.get("torch_dtype", "float32"))
        if name not in _DTYPES:
            raise self.fail(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[name]

    @property
    def rope(self) -> RopeConfig:
        return _rope(self.values, self.path)


def read_config(directory: Path) -> RawConfig:
    """``directory/config.json``, its architecture one this package serves; CheckpointError
    naming what is missing or unsupported."""
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} has no config.json: not a checkpoint directory"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return RawConfig(path, _architecture(raw, path), raw)


def _architecture(raw: dict[str, Any], path: Path) -> Architecture:
    names = raw.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise CheckpointError(f"{path}: 'architectures' must list the model class")
    try:
        return Architecture(names[0])
    except ValueError:
        served = ", ".join(a.value for a in Architecture)
        raise CheckpointError(
            f"{path}: architecture {names[0]!r} is not supported (served: {served})"
        ) from None


def dense_config(raw: RawConfig) -> HFConfig:
    """The sizes of a Llama / Qwen2 / Qwen3 checkpoint."""
    arch, path = raw.architecture, raw.path
    if arch not in DENSE_ARCHITECTURES:
        raise raw.fail(f"{arch.value} is not a dense GQA architecture")
    heads, hidden = raw.positive_int("num_attention_heads"), raw.positive_int("hidden_size")
    kv_heads = raw.positive_int("num_key_value_heads", heads)
    head_dim = raw.positive_int("head_dim", hidden // heads)
    if heads % kv_heads:
        raise raw.fail(f"{heads} attention heads are not a multiple of {kv_heads}")
    if head_dim % 2:
        raise raw.fail(f"head_dim {head_dim} must be even (rotary pairs)")
    _refuse_unsupported(raw.values, arch, path)
    return HFConfig(
        architecture=arch, vocab_size=raw.positive_int("vocab_size"), hidden=hidden,
        layers=raw.positive_int("num_hidden_layers"), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, intermediate=raw.positive_int("intermediate_size"),
        rms_eps=raw.number("rms_norm_eps", 1e-6, 0.0, 1.0), rope=raw.rope, dtype=raw.dtype,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch is Architecture.QWEN2 or bool(raw.get("attention_bias", False)),
        qk_norm=arch is Architecture.QWEN3,
        max_positions=raw.positive_int("max_position_embeddings", 1 << 20),
    )  # fmt: skip


def _refuse_unsupported(raw: dict[str, Any], arch: Architecture, path: Path) -> None:
    """Settings that would change the computation in ways this model does not implement."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias is not supported")
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        raise CheckpointError(f"{path}: sliding-window layers ({arch.value}) are not supported")
    types = raw.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        raise CheckpointError(f"{path}: layer_types other than 'full_attention' are not supported")
    if raw.get("pretraining_tp", 1) != 1:
        raise CheckpointError(f"{path}: pretraining_tp other than 1 is not supported")


def _rope(raw: dict[str, Any], path: Path) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: rope parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    name = params.get("rope_type", params.get("type", "default"))
    try:
        kind = RopeKind(name)
    except ValueError:
        supported = ", ".join(k.value for k in RopeKind)
        raise CheckpointError(
            f"{path}: rope type {name!r} is not supported ({supported})"
        ) from None
    values = {
        "theta": theta,
        "factor": params.get("factor", 1.0),
        "low_freq_factor": params.get("low_freq_factor", 1.0),
        "high_freq_factor": params.get("high_freq_factor", 4.0),
    }
    for key, value in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)
        ):
            raise CheckpointError(f"{path}: rope {key} must be a positive number, got {value!r}")
    if kind is RopeKind.LLAMA3 and "original_max_position_embeddings" not in params:
        raise CheckpointError(f"{path}: llama3 rope needs original_max_position_embeddings")
    original = params.get("original_max_position_embeddings", 8192)  # read by llama3 only
    if type(original) is not int or original < 1:
        raise CheckpointError(f"{path}: original_max_position_embeddings must be a positive int")
    return RopeConfig(
        theta=float(values["theta"]), kind=kind, factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]), original_max_positions=original,
    )  # fmt: skip
