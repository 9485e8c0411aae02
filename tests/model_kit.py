"""Shared pieces of the model tests (tests/models, tests/serving): the seeded model's small
configuration, how far two logits are apart, and transformers' greedy tokens."""

from __future__ import annotations

import functools
from typing import Any

import torch

from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.tiny import TinyTransformer

PAGE = 4
VOCAB = 512


def model_config(preset: ModelPreset) -> ModelConfig:
    return ModelConfig(
        preset=preset, vocab_size=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=8,
        page_size=PAGE, latent_dim=16, index_dim=8, state_dim=8,
        index_topk_pages=2,  # fewer pages than a prompt has: the DSA selection matters
        window=8,  # shorter than a prompt: the SWA mask matters
    )  # fmt: skip


@functools.cache
def tiny_model(preset: ModelPreset) -> TinyTransformer:
    return TinyTransformer(model_config(preset))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@torch.no_grad()
def reference_tokens(model: Any, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (no pad or end token)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False
    )
    return out[0, len(prompt) :].tolist()
