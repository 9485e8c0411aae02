"""Rotary position embedding as Hugging Face checkpoints define it: the frequencies of
:class:`~hicache.checkpoint.hf_config.RopeConfig`, and the half-split rotation (the first half of
a head's dims pairs with the second half), computed in float32 as transformers does so that
positions rotate to the same bits."""

from __future__ import annotations

import math

import torch

from hicache.checkpoint.hf_config import RopeConfig, RopeKind

__all__ = ["RotaryTable", "inverse_frequencies", "rotate_half_split"]


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Each rotary pair's frequency (head_dim / 2,) in float32."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (rope.theta**steps)
    if rope.kind is RopeKind.LINEAR:
        return inv / rope.factor
    if rope.kind is RopeKind.DEFAULT:
        return inv
    # llama3: long wavelengths slowed by ``factor``, short ones kept, the band between blended.
    old = rope.original_max_positions
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos and sin of positions, for one model's frequencies."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (n, head_dim), of ``positions`` (n,), in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (n, heads, D) rotated by (cos, sin) (n, D)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + turned * sin[:, None]
