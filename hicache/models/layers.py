"""The per-token layers every model has: RMSNorm, the SwiGLU MLP and routed experts (MoE).

Weights are read by their Hugging Face names (``{prefix}.gate_proj.weight`` ...), stored
(out, in) as ``F.linear`` takes them; the seeded model keeps its (in, out) matrices and hands
their transposed views, which ``F.linear`` multiplies as ``h @ w``, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "routed_experts", "swiglu", "swiglu_shapes"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32 (float64 stays float64), rounded back
    before the weight."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def swiglu_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
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
