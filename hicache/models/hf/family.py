"""What an architecture's module gives the loader (:class:`ModelFamily`), and the loading every
checkpoint model shares (:class:`CheckpointDecoder`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache.dtypes import DType
from hicache.models.attention import HeadSizes
from hicache.models.config import ModelConfig
from hicache.models.hf.config import RawConfig
from hicache.models.hf.weights import Shapes, TensorFiles
from hicache.models.step import PagedDecoder
from hicache.models.types import ServingModel

__all__ = ["CheckpointConfig", "CheckpointDecoder", "GqaCheckpointConfig", "ModelFamily"]


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """What every family's parsed config holds (each family's adds its own sizes)."""

    architecture: str  # ``architectures[0]`` of the config
    dtype: torch.dtype  # the checkpoint's
    vocab_size: int
    layers: int
    heads: int
    tie_embeddings: bool


@dataclass(frozen=True, slots=True)
class GqaCheckpointConfig(CheckpointConfig):
    """A family whose attention layers are GQA (:func:`~hicache.models.attention.gqa_attention`):
    ``heads`` query heads share ``kv_heads`` K/V heads of ``head_dim``."""

    kv_heads: int
    head_dim: int

    @property
    def head_sizes(self) -> HeadSizes:
        return HeadSizes(self.heads, self.kv_heads, self.head_dim)


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One kind of checkpoint: ``parse`` reads its config (CheckpointError naming what it does
    not support), ``tensor_shapes`` lists every tensor it must hold, ``model_config`` gives the
    pools' preset and sizes (pages of ``page_size`` tokens, K/V in ``kv_dtype``), and ``build``
    reads the tensors into the model."""

    parse: Callable[[RawConfig], Any]
    tensor_shapes: Callable[[Any], Shapes]
    model_config: Callable[[Any, int, DType], ModelConfig]
    build: Callable[[Any, ModelConfig, TensorFiles, torch.device], ServingModel]
    # Tensors a checkpoint may hold that the model never reads (not "unexpected").
    unread: Callable[[Any, str], bool] = lambda parsed, name: False


class CheckpointDecoder(PagedDecoder):
    """A :class:`~hicache.models.step.PagedDecoder` whose tensors come from a checkpoint
    (``cfg``: its parsed config, with ``rms_eps``), computing in the pools' dtype
    (``config.kv_dtype``). A subclass names its final norm and the tensors read in float32."""

    final_norm = "norm"  # model.{final_norm}.weight
    float32: tuple[str, ...] = ()  # names below model.layers.{i}.

    def __init__(
        self,
        cfg: Any,
        config: ModelConfig,
        files: TensorFiles,
        device: torch.device,
        shapes: Shapes,
    ) -> None:
        """Read ``shapes``' tensors (every tensor the model reads, by its checkpoint name)."""
        self.cfg, self.config, self.device = cfg, config, device
        self.dtype, self.eps = config.kv_dtype.to_torch(), cfg.rms_eps
        wide = {n for n in shapes if n.split(".", 3)[-1] in self.float32}
        weights = files.load({n: n for n in shapes if n not in wide}, self.dtype, device)
        weights |= files.load({n: n for n in wide}, torch.float32, device)
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)  # tied when absent
        self.norm = weights[f"model.{self.final_norm}.weight"]
        self.layers = [{} for _ in range(config.layers)]
        for name, tensor in weights.items():
            parts = name.split(".", 3)
            if parts[:2] == ["model", "layers"]:
                self.layers[int(parts[2])][parts[3]] = tensor
