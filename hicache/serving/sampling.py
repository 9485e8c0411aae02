"""Drawing the next token from a request's logits, the same with and without the cache."""

from __future__ import annotations

import zlib

import torch

__all__ = ["sample_token"]


def sample_token(
    logits: torch.Tensor, temperature: float, seed: int, rid: str, position: int
) -> int:
    """Greedy at ``temperature`` 0, else a draw seeded by ``seed``, the request id and the
    output ``position`` only: no other request, batch or cache state can change it."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    draw_seed = zlib.crc32(f"{seed}:{rid}:{position}".encode())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(draw_seed)))
