"""A Hugging Face ``config.json`` as read (:class:`RawConfig`): its architecture's name, typed
getters whose errors name the file and the field, and the rotary embedding it sets, every
unsupported or inconsistent setting refused by name before anything is allocated. Each
architecture reads its own sizes from it (:mod:`hicache.models.hf.registry`).

Both spellings transformers has written are read: ``rope_parameters`` (5.x) and ``rope_theta``
with ``rope_scaling`` (4.x); ``dtype`` and ``torch_dtype``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hicache.errors import CheckpointError
from hicache.models.rope import RopeConfig, RopeKind, YarnRope

__all__ = ["DTYPES", "RawConfig", "read_config", "rope_and_scale"]


# The dtypes a checkpoint may be stored in (``dtype`` / ``torch_dtype``), by name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RawConfig:
    """A ``config.json`` as read, with typed getters whose errors name the file and field."""

    path: Path
    architecture: str  # ``architectures[0]``: the transformers class that computes it
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

    def require(self, name: str, value: Any) -> None:
        """CheckpointError unless ``name`` is ``value`` (or absent): a setting this package
        computes one way only."""
        given = self.values.get(name, value)
        if given != value:
            raise self.fail(f"{name} {given!r} is not supported (only {value!r})")

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {problem}")

    @property
    def dtype(self) -> torch.dtype:
        name = self.values.get("dtype", self.values.get("torch_dtype", "float32"))
        if name not in DTYPES:
            raise self.fail(f"dtype {name!r} is not one of {sorted(DTYPES)}")
        return DTYPES[name]

    @property
    def rope(self) -> RopeConfig:
        return _rope(self.values, self.path)


def read_config(directory: Path) -> RawConfig:
    """``directory/config.json``; CheckpointError naming what is missing or unreadable."""
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


def _architecture(raw: dict[str, Any], path: Path) -> str:
    names = raw.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise CheckpointError(f"{path}: 'architectures' must list the model class")
    return names[0]


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


_ROPE_KINDS = ("default", "linear", "llama3", "yarn")


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
