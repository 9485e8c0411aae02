"""``open_checkpoint`` / ``load_checkpoint``: a Hugging Face checkpoint directory to a model the
serving engine runs.

Everything that can be wrong with the directory (no config, an unsupported architecture or
setting, missing, misshapen or unexpected tensors, a size the pools cannot hold) is refused with
one :class:`~hicache.errors.CheckpointError` before any tensor is read. Each architecture belongs
to a :class:`~hicache.models.hf.family.ModelFamily` (:data:`~hicache.models.hf.registry.FAMILIES`):
how its config is read, which tensors it has, which pools it needs, and the model that computes
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hicache.dtypes import DType
from hicache.errors import CheckpointError, ConfigError
from hicache.models.config import ModelConfig
from hicache.models.hf.config import DTYPES, read_config
from hicache.models.hf.family import CheckpointConfig, ModelFamily
from hicache.models.hf.registry import FAMILIES
from hicache.models.hf.weights import TensorFiles, check_tensors
from hicache.models.types import ServingModel

__all__ = [
    "COMPUTE_DTYPES",
    "CheckpointPlan",
    "compute_dtype",
    "load_checkpoint",
    "open_checkpoint",
]

COMPUTE_DTYPES = DTYPES  # a checkpoint computes in any dtype it may be stored in


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
    parsed: CheckpointConfig  # the family's config
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
            "architecture": self.parsed.architecture,
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
        served = ", ".join(FAMILIES)
        raise raw.fail(f"architecture {raw.architecture!r} is not supported (served: {served})")
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
