"""``open_checkpoint`` / ``load_checkpoint``: a Hugging Face checkpoint directory to a model the
serving engine runs.

Everything that can be wrong with the directory (no config, an unsupported architecture or
setting, missing, misshapen or unexpected tensors, a size the pools cannot hold) is refused with
one :class:`~hicache.errors.CheckpointError` before any tensor is read. Each architecture belongs
to a :class:`ModelFamily`: how its config is read, which tensors it has, which pools it needs,
and the model that computes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from hicache.checkpoint.deepseek import (
    DeepseekV3Model,
    deepseek_config,
    deepseek_model_config,
    deepseek_tensor_shapes,
)
from hicache.checkpoint.dense import DenseCheckpointModel, dense_tensor_shapes
from hicache.checkpoint.hf_config import (
    DENSE_ARCHITECTURES,
    Architecture,
    HFConfig,
    RawConfig,
    dense_config,
    read_config,
)
from hicache.checkpoint.jamba import (
    JambaModel,
    jamba_config,
    jamba_model_config,
    jamba_tensor_shapes,
)
from hicache.checkpoint.weights import TensorFiles, check_tensors
from hicache.dtypes import DType
from hicache.errors import CheckpointError, ConfigError
from hicache.serving.model import ServingModel
from hicache.serving.presets import ModelConfig, ModelPreset

__all__ = [
    "COMPUTE_DTYPES",
    "FAMILIES",
    "CheckpointPlan",
    "FamilyConfig",
    "ModelFamily",
    "compute_dtype",
    "load_checkpoint",
    "open_checkpoint",
]

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FamilyConfig(Protocol):
    """What every family's parsed config tells the loader."""

    @property
    def architecture(self) -> Architecture: ...
    @property
    def dtype(self) -> torch.dtype: ...  # the checkpoint's


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One kind of checkpoint: ``parse`` reads its config (CheckpointError naming what it does
    not support), ``tensor_shapes`` lists every tensor it must hold, ``model_config`` gives the
    pools' preset and sizes (pages of ``page_size`` tokens, K/V in ``kv_dtype``), and ``build``
    reads the tensors into the model."""

    parse: Callable[[RawConfig], Any]
    tensor_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    model_config: Callable[[Any, int, DType], ModelConfig]
    build: Callable[[Any, ModelConfig, TensorFiles, torch.device], ServingModel]
    # Tensors a checkpoint may hold that the model never reads (not "unexpected").
    unread: Callable[[Any, str], bool] = lambda parsed, name: False


def _dense_model_config(hf: HFConfig, page_size: int, kv_dtype: DType) -> ModelConfig:
    return ModelConfig(
        preset=ModelPreset.DENSE, vocab_size=hf.vocab_size, hidden=hf.hidden,
        layers=hf.layers, heads=hf.heads, kv_heads=hf.kv_heads, head_dim=hf.head_dim,
        page_size=page_size, kv_dtype=kv_dtype,
    )  # fmt: skip


_DENSE = ModelFamily(dense_config, dense_tensor_shapes, _dense_model_config, DenseCheckpointModel)
FAMILIES: dict[Architecture, ModelFamily] = dict.fromkeys(DENSE_ARCHITECTURES, _DENSE)


def _past_last_layer(parsed: Any, name: str) -> bool:
    """``model.layers.N.*`` with N past the decoder's layers: DeepSeek's multi-token-prediction
    modules, which real checkpoints hold and greedy decoding does not run."""
    parts = name.split(".")
    return (
        parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= parsed.layers
    )


FAMILIES[Architecture.DEEPSEEK_V3] = ModelFamily(
    deepseek_config, deepseek_tensor_shapes, deepseek_model_config, DeepseekV3Model,
    unread=_past_last_layer,
)  # fmt: skip
FAMILIES[Architecture.JAMBA] = ModelFamily(
    jamba_config, jamba_tensor_shapes, jamba_model_config, JambaModel
)


def compute_dtype(
    checkpoint: torch.dtype, device: torch.device, requested: torch.dtype | None
) -> torch.dtype:
    """``requested``, else the checkpoint's dtype on CUDA and float32 on a CPU (whose half
    precision matmuls are slow and whose torch kernels for them are not everywhere)."""
    if requested is not None:
        return requested
    return checkpoint if device.type == "cuda" else torch.float32


@dataclass(frozen=True, slots=True)
class CheckpointPlan:
    """A checkpoint checked and sized, its tensors not read yet (see :func:`open_checkpoint`)."""

    directory: Path
    family: ModelFamily
    parsed: Any  # the family's config
    config: ModelConfig  # the pools' preset and sizes, K/V in the compute dtype
    files: TensorFiles
    device: torch.device

    @property
    def weight_bytes(self) -> int:
        """What the weights take once loaded in the compute dtype."""
        element = self.config.kv_dtype.itemsize
        shapes = self.family.tensor_shapes(self.parsed)
        return sum(math.prod(shape) for shape in shapes.values()) * element

    def describe(self) -> dict[str, object]:
        """For reports: where the model came from and how it computes."""
        return {
            "checkpoint": str(self.directory),
            "architecture": self.parsed.architecture.value,
            "dtype": self.config.kv_dtype.label,
        }

    def load(self) -> ServingModel:
        return self.family.build(self.parsed, self.config, self.files, self.device)


def open_checkpoint(
    directory: str | Path,
    device: torch.device,
    page_size: int,
    dtype: torch.dtype | None = None,
) -> CheckpointPlan:
    """The model in ``directory`` checked against its tensors' headers, computing and caching
    in :func:`compute_dtype`'s dtype with pools of ``page_size`` tokens a page; nothing is
    read but the config and the headers."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"--model {directory}: not a directory")
    raw = read_config(path)
    family = FAMILIES.get(raw.architecture)
    if family is None:
        raise raw.fail(f"architecture {raw.architecture.value} has no model here yet")
    parsed = family.parse(raw)
    files = TensorFiles(path)
    check_tensors(files, family.tensor_shapes(parsed), lambda name: family.unread(parsed, name))
    compute = DType.from_torch(compute_dtype(parsed.dtype, device, dtype))
    try:
        config = family.model_config(parsed, page_size, compute)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: the pools cannot hold this model: {exc}") from None
    return CheckpointPlan(path, family, parsed, config, files, device)


def load_checkpoint(
    directory: str | Path,
    device: torch.device,
    page_size: int,
    dtype: torch.dtype | None = None,
) -> ServingModel:
    """:func:`open_checkpoint`, then its tensors read."""
    return open_checkpoint(directory, device, page_size, dtype).load()
