"""What every checkpoint model does the same way: a step's chunks checked and laid out, the
one-chunk ``forward``, transformers' RMSNorm numerics, the tensors every decoder has, SwiGLU
feed-forward blocks and routed experts."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hicache.checkpoint.paged_attention import StepLayout
from hicache.pools.device import DevicePool
from hicache.serving.model import ChunkInput, LayerWait

__all__ = [
    "OneChunk",
    "decoder_shapes",
    "last_logits",
    "rms_norm",
    "routed_experts",
    "step_inputs",
    "swiglu",
    "swiglu_shapes",
]

Shapes = dict[str, tuple[int, ...]]


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


def last_logits(lasts: torch.Tensor, lm_head: torch.Tensor) -> list[torch.Tensor]:
    """Each chunk's logits (vocab,) in float32 on the CPU from its last hidden state (``lasts``:
    (chunks, hidden)). Computed as ``lm_head @ lasts.T``: a step has a few chunks, and for so
    few rows MKL's ``lasts @ lm_head.T`` path read a (32000, 512) float32 head at a third to a
    sixth of the speed on the 2-core AMD EPYC the project is measured on (2-6 rows: 13-24 ms
    against 2.5-7.4 ms), and its matrix-vector path for one row as slowly (7.3 ms): one row is
    computed as two."""
    rows = len(lasts)
    wide = lasts if rows > 1 else torch.cat([lasts, lasts])
    logits = torch.mm(lm_head, wide.T).T[:rows]  # wide.T as a view: MKL's fast operand order
    return list(logits.to(torch.float32).cpu())


class OneChunk:
    """``forward`` of one chunk through the model's ``forward_batch``."""

    forward_batch: Any

    def forward(
        self, chunk: ChunkInput, pools: Mapping[str, DevicePool], wait: LayerWait | None = None
    ) -> torch.Tensor:
        """Logits of the chunk's last token (vocab,), after caching the chunk's state."""
        out: torch.Tensor = self.forward_batch([chunk], pools, wait)[0]
        return out


def decoder_shapes(
    vocab: int,
    hidden: int,
    tied: bool,
    final_norm: str,
    layers: int,
    layer: Callable[[int], Shapes],
) -> Shapes:
    """A decoder checkpoint's tensors (transformers' names): the embedding, the final norm
    ``model.{final_norm}.weight``, ``lm_head`` unless ``tied``, and ``layer(i)``'s tensors
    below ``model.layers.{i}.``."""
    shapes: Shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        f"model.{final_norm}.weight": (hidden,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer(i).items()})
    return shapes


def swiglu_shapes(prefix: str, hidden: int, inner: int) -> Shapes:
    return {
        f"{prefix}.gate_proj.weight": (inner, hidden),
        f"{prefix}.up_proj.weight": (inner, hidden),
        f"{prefix}.down_proj.weight": (hidden, inner),
    }


def swiglu(weights: Mapping[str, torch.Tensor], prefix: str, h: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(h)) * up(h))`` with the tensors :func:`swiglu_shapes` names."""
    gate = F.silu(F.linear(h, weights[f"{prefix}.gate_proj.weight"]))
    up = F.linear(h, weights[f"{prefix}.up_proj.weight"])
    return F.linear(gate * up, weights[f"{prefix}.down_proj.weight"])


def routed_experts(
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    h: torch.Tensor,
    experts: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """The weighted sum of each token's experts (``experts`` (N, per_token) indices, ``scale``
    their weights, same shape), each expert a SwiGLU ``{prefix}.{e}`` run over its own tokens
    only, the experts in index order; grouped by one sort and one host sync for the group
    sizes rather than a mask per expert."""
    per_token = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat).tolist()
    scale = scale.reshape(-1)
    out = torch.zeros_like(h)
    begin = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        picks = order[begin : begin + count]
        begin += count
        tokens = picks // per_token
        y = swiglu(weights, f"{prefix}.{expert}", h[tokens]) * scale[picks, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
