"""Jamba's Mamba mixer (transformers' ``JambaMambaMixer``, its pure-torch path) over the hybrid
preset's state pools (:mod:`hicache.models.recurrent`).

Per token: ``in_proj`` splits into the SSM input ``x`` and the gate ``z``; a causal depthwise
convolution of width ``d_conv`` over ``x`` then silu gives ``u``; ``x_proj`` of ``u`` gives the
time step, ``B`` and ``C``, each RMS-normed (Jamba's addition to Mamba); the time step goes
through ``dt_proj`` and softplus; the state ``S`` (d_inner, d_state) becomes
``exp(A * dt) * S + dt * B * u``; the output ``S C + D u``, gated by ``silu(z)``, goes through
``out_proj``.

The state lives in pool ``conv`` (the last ``d_conv - 1`` conv inputs) and pool ``ssm``
(``S``, float32 as transformers computes it), per request, carried as every recurrent layer
carries it (:func:`~hicache.models.recurrent.scan_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.models.layers import rms_norm
from hicache.models.recurrent import read_state, scan_state
from hicache.models.step import Step
from hicache.models.types import ChunkInput
from hicache.pools.device import DevicePool

__all__ = ["MambaSizes", "mamba_layer", "mamba_shapes"]


@dataclass(frozen=True, slots=True)
class MambaSizes:
    """One Mamba mixer's sizes (every Mamba layer of a Jamba checkpoint has the same)."""

    hidden: int
    inner: int  # mamba_expand * hidden_size
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool  # mamba_conv_bias
    proj_bias: bool  # mamba_proj_bias: in_proj and out_proj have biases
    rms_eps: float


def mamba_shapes(s: MambaSizes) -> dict[str, tuple[int, ...]]:
    """The mixer's tensors (names below ``model.layers.{i}.``) with their shapes."""
    shapes: dict[str, tuple[int, ...]] = {
        "mamba.in_proj.weight": (2 * s.inner, s.hidden),
        "mamba.conv1d.weight": (s.inner, 1, s.d_conv),
        "mamba.x_proj.weight": (s.dt_rank + 2 * s.d_state, s.inner),
        "mamba.dt_proj.weight": (s.inner, s.dt_rank),
        "mamba.dt_proj.bias": (s.inner,),
        "mamba.A_log": (s.inner, s.d_state),
        "mamba.D": (s.inner,),
        "mamba.out_proj.weight": (s.hidden, s.inner),
        "mamba.dt_layernorm.weight": (s.dt_rank,),
        "mamba.b_layernorm.weight": (s.d_state,),
        "mamba.c_layernorm.weight": (s.d_state,),
    }
    if s.conv_bias:
        shapes["mamba.conv1d.bias"] = (s.inner,)
    if s.proj_bias:
        shapes["mamba.in_proj.bias"] = (2 * s.inner,)
        shapes["mamba.out_proj.bias"] = (s.hidden,)
    return shapes


def mamba_layer(
    s: MambaSizes, w: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step, layer: int
) -> torch.Tensor:
    """The mixer over each chunk of the step: ``h`` (N, hidden) the normed hidden states,
    ``layer`` the layer's number in the state pools; (N, hidden)."""
    return torch.cat([_mixer(s, w, h[rows], step.pools, layer, c) for rows, c in step.each()])


def _mixer(
    s: MambaSizes,
    w: Mapping[str, torch.Tensor],
    h: torch.Tensor,
    pools: Mapping[str, DevicePool],
    layer: int,
    chunk: ChunkInput,
) -> torch.Tensor:
    x, gate = F.linear(h, w["mamba.in_proj.weight"], w.get("mamba.in_proj.bias")).chunk(2, -1)
    conv_state, state = read_state(pools, layer, chunk, h.dtype, torch.float32)
    store = pools["conv"].buffer.dtype
    xs = torch.cat([conv_state, x.to(store).to(h.dtype)])  # inputs from position start - k + 1
    conv = F.conv1d(
        xs.T[None], w["mamba.conv1d.weight"], w.get("mamba.conv1d.bias"), groups=s.inner
    )
    u = F.silu(conv[0].T)  # (n, inner)
    dt, b, c = _selection(s, w, u)
    a = -torch.exp(w["mamba.A_log"].float())  # (inner, d_state)
    decay = torch.exp(a[None] * dt[:, :, None])  # (n, inner, d_state)
    push = dt[:, :, None] * b.float()[:, None, :] * u.float()[:, :, None]
    y = scan_state(pools, layer, chunk, xs, state, decay, push, c) + u * w["mamba.D"].float()
    y = y * F.silu(gate)
    return F.linear(y.to(h.dtype), w["mamba.out_proj.weight"], w.get("mamba.out_proj.bias"))


def _selection(
    s: MambaSizes, w: Mapping[str, torch.Tensor], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input-dependent time step (n, inner) in float32, and B and C (n, d_state)."""
    projected = F.linear(u, w["mamba.x_proj.weight"])
    dt, b, c = torch.split(projected, [s.dt_rank, s.d_state, s.d_state], dim=-1)
    dt = rms_norm(dt, w["mamba.dt_layernorm.weight"], s.rms_eps)
    b = rms_norm(b, w["mamba.b_layernorm.weight"], s.rms_eps)
    c = rms_norm(c, w["mamba.c_layernorm.weight"], s.rms_eps)
    # transformers adds the bias after the projection and applies softplus in the compute dtype
    dt = F.linear(dt, w["mamba.dt_proj.weight"]) + w["mamba.dt_proj.bias"]
    return F.softplus(dt).float(), b, c
