"""Drawing the next token from a request's logits, the same with and without the cache."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

__all__ = ["Draw", "sample_token"]


@dataclass(frozen=True, slots=True)
class Draw:
    """How one request draws: ``temperature`` 0 is greedy; ``top_p`` keeps the smallest set
    of most likely tokens whose probability reaches it; ``seed`` (the request's own, else
    None) makes the draws a function of it and the output position alone."""

    temperature: float
    top_p: float = 1.0
    seed: int | None = None


def sample_token(
    logits: torch.Tensor, draw: Draw, engine_seed: int, rid: str, position: int
) -> int:
    """Greedy at temperature 0, else a draw seeded by the request's seed (or the engine's seed
    and the request id) and the output ``position`` only: no other request, batch or cache
    state can change it."""
    if draw.temperature <= 0:
        return int(torch.argmax(logits))
    if draw.seed is not None:
        draw_seed = zlib.crc32(f"request:{draw.seed}:{position}".encode())
    else:
        draw_seed = zlib.crc32(f"{engine_seed}:{rid}:{position}".encode())
    probs = torch.softmax(logits.double() / draw.temperature, dim=-1)
    if draw.top_p < 1.0:
        probs = _nucleus(probs, draw.top_p)
    return int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(draw_seed)))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with all but the smallest most likely set reaching ``top_p`` zeroed (the most
    likely token is always kept)."""
    ordered, order = torch.sort(probs, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the tokens ranked above each
    ordered[before >= top_p] = 0.0
    out = torch.zeros_like(probs)
    out[order] = ordered
    return out
