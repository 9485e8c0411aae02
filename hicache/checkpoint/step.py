"""What every checkpoint model does the same way: a step's chunks checked and laid out, the
one-chunk ``forward``, and transformers' RMSNorm numerics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hicache.checkpoint.paged_attention import StepLayout
from hicache.pools.device import DevicePool
from hicache.serving.model import ChunkInput, LayerWait

__all__ = ["OneChunk", "rms_norm", "step_inputs"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, rounded back before the weight."""
    wide = x.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def step_inputs(
    chunks: Sequence[ChunkInput], hot: object | None, vocab_size: int, device: torch.device
) -> tuple[StepLayout, torch.Tensor]:
    """The step's layout and token ids (on ``device``); ValueError for an empty chunk, an id
    outside the vocabulary, or a HiSparse hot buffer (the ``dsa`` preset's only)."""
    if hot is not None:
        raise ValueError("HiSparse serves the dsa preset only, not a checkpoint model")
    if not chunks or any(len(c.tokens) == 0 for c in chunks):
        raise ValueError("a step needs chunks of at least one token")
    ids = torch.cat([c.tokens for c in chunks]).to(device)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    layout = StepLayout.of(
        [c.start for c in chunks], [c.slots.to(device) for c in chunks],
        [len(c.tokens) for c in chunks],
    )  # fmt: skip
    return layout, ids


class OneChunk:
    """``forward`` of one chunk through the model's ``forward_batch``."""

    forward_batch: Any

    def forward(
        self, chunk: ChunkInput, pools: Mapping[str, DevicePool], wait: LayerWait | None = None
    ) -> torch.Tensor:
        """Logits of the chunk's last token (vocab,), after caching the chunk's state."""
        out: torch.Tensor = self.forward_batch([chunk], pools, wait)[0]
        return out
