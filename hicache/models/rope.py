"""Rotary position embeddings: the frequencies (default, linear, llama3 and yarn scaling), the
cos and sin of positions, and the rotation of a vector's pairs.

Two pairings exist: half-split (dim ``i`` pairs with ``i + D/2``, as Hugging Face checkpoints
rotate) and interleaved (``2i`` with ``2i + 1``: the seeded model, and DeepSeek-V3 checkpoints,
which transformers de-interleaves first). Both rotate through :func:`rotate_half_split`; an
interleaved vector is de-interleaved around it, which gives the same bits as rotating its pairs
in place. cos and sin are computed in the frequencies' dtype: float32 for checkpoints, as
transformers computes them, float64 for the seeded model on a CPU.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = [
    "Pairing",
    "RopeConfig",
    "RopeKind",
    "RotaryTable",
    "Rotation",
    "YarnRope",
    "deinterleave",
    "inverse_frequencies",
    "rotate",
    "rotate_half_split",
    "rotate_interleaved",
    "yarn_frequencies",
]


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
class YarnRope:
    """transformers' ``yarn`` rotary scaling (DeepSeek-V3's long-context setting)."""

    theta: float
    factor: float
    original_max_positions: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float  # cos and sin are multiplied by it


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Each rotary pair's frequency (head_dim / 2,) in ``dtype``."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim
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


def yarn_frequencies(rope: YarnRope, dim: int) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters``: the slow pairs interpolated (divided by
    ``factor``), the fast ones kept, a linear ramp between; float32."""
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


class RotaryTable:
    """cos and sin of positions for one set of frequencies (``inv_freq``, whose dtype the
    angles are computed in), each multiplied by ``scaling`` (yarn's attention factor)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq
        self.scaling = scaling

    @classmethod
    def of(cls, rope: RopeConfig | YarnRope, dim: int, device: torch.device) -> RotaryTable:
        """A checkpoint's table: float32 angles of ``dim`` dims, as transformers computes."""
        if isinstance(rope, YarnRope):
            return cls(yarn_frequencies(rope, dim).to(device), rope.attention_factor)
        return cls(inverse_frequencies(rope, dim).to(device))

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each ``positions.shape + (D,)`` (the pairs' angles twice, half-split
        order), in ``dtype``."""
        freqs = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (..., D) rotated by (cos, sin), broadcastable to it: dim ``i`` pairs with
    ``i + D/2``."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``x``'s even dims, then its odd ones: interleaved pairs in half-split order."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (..., D) whose pairs are dims ``2i`` and ``2i + 1``, rotated by (cos, sin) of
    :meth:`RotaryTable.at` and left in its own order."""
    half = x.shape[-1] // 2
    turned = rotate_half_split(deinterleave(x), cos, sin)
    out = torch.empty_like(x)
    out[..., 0::2] = turned[..., :half]
    out[..., 1::2] = turned[..., half:]
    return out


class Pairing(enum.Enum):
    """Which dims of a head rotate together, and the order a rotated head comes back in."""

    HALF_SPLIT = "half_split"  # dim i with i + D/2 (Hugging Face checkpoints)
    INTERLEAVED = "interleaved"  # 2i with 2i + 1, left in place (the seeded model)
    # 2i with 2i + 1, returned in half-split order (DeepSeek-V3 as transformers computes it)
    DEINTERLEAVED = "deinterleaved"


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: Pairing) -> torch.Tensor:
    """``x`` (..., D) rotated by (cos, sin) of :meth:`RotaryTable.at`, paired as ``pairing``."""
    if pairing is Pairing.INTERLEAVED:
        return rotate_interleaved(x, cos, sin)
    if pairing is Pairing.DEINTERLEAVED:
        x = deinterleave(x)
    return rotate_half_split(x, cos, sin)


@dataclass(frozen=True, slots=True)
class Rotation:
    """A step's rotary embedding: cos and sin (N, D) of its tokens' positions, and the
    pairing; called on per-head vectors (N, heads, D) of the same tokens."""

    cos: torch.Tensor
    sin: torch.Tensor
    pairing: Pairing

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.cos[:, None], self.sin[:, None], self.pairing)

    def rows(self, rows: slice) -> Rotation:
        """The rotation of the tokens ``rows`` (one chunk's)."""
        return Rotation(self.cos[rows], self.sin[rows], self.pairing)
