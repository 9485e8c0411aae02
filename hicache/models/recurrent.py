"""Recurrent layers over the state pools: the state kept per request in pools ``conv`` (the
last ``kernel - 1`` inputs of the causal convolution) and ``ssm`` (the SSM state ``S``), and
the scan that carries ``S`` through a chunk; the seeded model's mixer on top
(:func:`seeded_recurrent_layer`; Jamba's Mamba mixer is :mod:`hicache.models.mamba`).

A chunk starts from its working slot (zeros at a sequence's start, or a cached snapshot's slot
when ``state_from`` is set), runs its tokens in order, copies the state into the snapshot slots
it is asked for, and leaves the state after its last token in the working slot. ``S`` is
rounded to the ``ssm`` pool's dtype at every token (and the conv inputs to the ``conv`` pool's
as they enter), so a state resumed from a slot continues exactly as if computed through.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from hicache.errors import InvalidArgumentError
from hicache.models.step import LayerContext, Step
from hicache.models.types import ChunkInput
from hicache.pools.device import DevicePool

__all__ = ["read_state", "scan_state", "seeded_recurrent_layer", "snapshots_by_step"]


def read_state(
    pools: Mapping[str, DevicePool],
    layer: int,
    chunk: ChunkInput,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv state (kernel - 1, inner) in ``conv_dtype``, SSM state in ``ssm_dtype``) after
    ``chunk.start`` tokens: zeros at the start of a sequence, else the ``state_from`` slot's
    (a cached snapshot), else the working slot's."""
    conv_pool, ssm_pool = pools["conv"], pools["ssm"]
    size = conv_pool.size
    if chunk.state_slot is None or not 0 <= chunk.state_slot < size:
        raise InvalidArgumentError(
            f"recurrent layers need a working state slot, got {chunk.state_slot!r}"
        )
    slot = chunk.state_slot if chunk.state_from is None else chunk.state_from
    if not 0 <= slot < size:
        raise InvalidArgumentError(f"state_from {slot!r} is not a slot of the state pools")
    if chunk.start == 0:
        device = conv_pool.buffer.device
        conv = torch.zeros(conv_pool.spec.layout.item_shape, dtype=conv_dtype, device=device)
        return conv, torch.zeros(ssm_pool.spec.layout.item_shape, dtype=ssm_dtype, device=device)
    conv = conv_pool.buffer[0, layer, slot].to(conv_dtype)
    return conv, ssm_pool.buffer[0, layer, slot].to(ssm_dtype)


def scan_state(
    pools: Mapping[str, DevicePool],
    layer: int,
    chunk: ChunkInput,
    xs: torch.Tensor,
    state: torch.Tensor,
    decay: torch.Tensor,
    push: torch.Tensor,
    c: torch.Tensor,
) -> torch.Tensor:
    """Per token ``t`` of the chunk, ``S = decay[t] * S + push[t]`` (rounded to the ``ssm``
    pool's dtype, computed in ``state``'s) read out as ``S @ c[t]``: (n, inner). ``xs`` are the
    conv inputs from position ``start - kernel + 1``; the state after ``p`` tokens goes to the
    snapshot slots the chunk asks for, the state after the chunk to its working slot."""
    n = len(c)
    kernel = len(xs) - n + 1
    store = pools["ssm"].buffer.dtype
    snapshots = snapshots_by_step(chunk.snapshots, chunk.start, n)
    outs = []
    if 0 in snapshots:
        _write_state(pools, layer, snapshots[0], xs[: kernel - 1], state)
    for t in range(n):
        state = (decay[t] * state + push[t]).to(store).to(state.dtype)
        outs.append(state.to(c.dtype) @ c[t])
        if t + 1 in snapshots:
            _write_state(pools, layer, snapshots[t + 1], xs[t + 1 : t + kernel], state)
    assert chunk.state_slot is not None  # read_state checked it
    _write_state(pools, layer, chunk.state_slot, xs[n:], state)
    return torch.stack(outs)


def snapshots_by_step(snapshots: Mapping[int, int], start: int, n: int) -> dict[int, int]:
    """A chunk's snapshot slots (position -> slot) keyed by tokens computed in it (0 .. n)."""
    out = {}
    for position, slot in snapshots.items():
        if not start <= position <= start + n:
            raise InvalidArgumentError(
                f"a snapshot at {position} is outside the chunk {start}..{start + n}"
            )
        out[position - start] = slot
    return out


def _write_state(
    pools: Mapping[str, DevicePool],
    layer: int,
    slot: int,
    conv: torch.Tensor,
    state: torch.Tensor,
) -> None:
    conv_pool, ssm_pool = pools["conv"], pools["ssm"]
    conv_pool.buffer[0, layer, slot] = conv.to(conv_pool.buffer.dtype)
    ssm_pool.buffer[0, layer, slot] = state.to(ssm_pool.buffer.dtype)


def seeded_recurrent_layer(
    ctx: LayerContext, w: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step, layer: int
) -> torch.Tensor:
    """The seeded model's Mamba-like layer over each chunk of the step: ``x = in_proj(h)``; a
    causal depthwise convolution of width ``conv_kernel`` over ``x`` (its weights
    ``mixer.conv``, (kernel, inner)); ``u = silu(conv)``; a per-channel state ``S`` updated per
    token as ``S = decay * S + u B_t^T`` and read as ``y = S C_t`` (``B``, ``C``: ``b_proj``,
    ``c_proj`` of ``h``); out ``out_proj(y)``. Everything computes in the model's dtype."""
    pools = step.pools
    store = pools["conv"].buffer.dtype
    kernel = ctx.config.conv_kernel
    outs = []
    for rows, chunk in step.each():
        hc = h[rows]
        conv_state, state = read_state(pools, layer, chunk, ctx.dtype, ctx.dtype)
        x = F.linear(hc, w["mixer.in_proj.weight"]).to(store).to(ctx.dtype)
        xs = torch.cat([conv_state, x])  # (kernel - 1 + n, inner): from position start - k + 1
        n = x.shape[0]
        conv = xs[:n] * w["mixer.conv"][0]
        for k in range(1, kernel):  # in a fixed order: the same sums whatever the chunk
            conv = conv + xs[k : k + n] * w["mixer.conv"][k]
        u = F.silu(conv)
        b = F.linear(hc, w["mixer.b_proj.weight"])
        c = F.linear(hc, w["mixer.c_proj.weight"])
        decay = w["mixer.decay"][:, None].expand(n, *state.shape)
        push = u[:, :, None] * b[:, None, :]
        y = scan_state(pools, layer, chunk, xs, state, decay, push, c)
        outs.append(F.linear(y, w["mixer.out_proj.weight"]))
    return torch.cat(outs)
