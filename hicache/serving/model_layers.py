"""The layer kinds of the serving model: each writes the new tokens' state into its pool, then
reads what it attends to back from the pool (see :mod:`hicache.serving.model`): the whole context
for full attention, the window for sliding-window layers, the window and the compressed entries
for dsv4's layers; recurrent layers carry a state from the request's working slot instead."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache.pools.device import DevicePool

if TYPE_CHECKING:
    from hicache.serving.model import TinyTransformer

__all__ = [
    "AttentionInputs",
    "rotary_frequencies",
    "rotate",
    "attention_layer",
    "latent_layer",
    "recurrent_layer",
    "snapshots_by_step",
    "window_layer",
    "write_state",
]

_FP8_MAX = 448.0  # largest float8_e4m3fn value


@dataclass(slots=True)
class AttentionInputs:
    slots: torch.Tensor  # (T,) slots of positions 0 .. T-1
    start: int  # first new position
    positions: torch.Tensor  # (n,) new positions
    pool_slots: dict[str, torch.Tensor] = field(default_factory=dict)  # see ChunkInput
    state_slot: int | None = None
    snapshots: dict[int, int] = field(default_factory=dict)
    state_from: int | None = None
    hot_row: int | None = None  # HiSparse: its row of the hot buffer (see ChunkInput)

    @property
    def new_slots(self) -> torch.Tensor:
        return self.slots[self.start :]


def rotary_frequencies(dim: int) -> torch.Tensor:
    """The rotary embedding's frequency of each pair of a ``dim``-wide vector, float64."""
    return 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def rotate(x: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim of ``x`` (..., D) at ``positions`` (broadcastable to
    ``x.shape[:-1]``), with ``frequencies`` (D / 2) from :func:`rotary_frequencies`."""
    angles = positions.to(x.dtype)[..., None] * frequencies
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _attend(
    model: TinyTransformer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inp: AttentionInputs,
    window: int | None = None,
    allowed: torch.Tensor | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Causal attention of queries (n, H, D) over keys and values (T, Hk, D) of positions
    ``key_start ..``; (n, H*D)."""
    key_pos = torch.arange(key_start, key_start + k.shape[0], device=q.device)
    mask = key_pos[None, :] <= inp.positions[:, None]
    if window is not None:
        mask &= key_pos[None, :] > inp.positions[:, None] - window
    if allowed is not None:
        mask &= allowed
    return _attend_masked(q, k, v, mask)


def _attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention of queries (n, H, D) over keys and values (T, Hk, D) where ``mask`` (n, T)
    allows; (n, H*D)."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(n, kv_heads, heads // kv_heads, dim)  # query heads sharing a KV head
    scores = torch.einsum("nkgd,tkd->kgnt", grouped, k) / math.sqrt(dim)
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return torch.einsum("kgnt,tkd->nkgd", probs, v).reshape(n, heads * dim)


def attention_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pool: DevicePool,
    layer: int,
    inp: AttentionInputs,
) -> torch.Tensor:
    """GQA attention over the whole context, through the anchor pool's slots."""
    q, k, v = _qkv(model, p, h, inp)
    store = pool.buffer.dtype
    pool.buffer[0, layer, inp.new_slots] = k.to(store)
    pool.buffer[1, layer, inp.new_slots] = v.to(store)
    keys = pool.buffer[0, layer, inp.slots].to(model.dtype)
    values = pool.buffer[1, layer, inp.slots].to(model.dtype)
    return _attend(model, q, keys, values, inp) @ p["wo"]


def window_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pool: DevicePool,
    layer: int,
    inp: AttentionInputs,
) -> torch.Tensor:
    """Sliding-window attention over the last ``config.window`` positions (a query at ``q``
    sees ``q - window + 1 .. q``), read through the window pool's own slots
    (``inp.pool_slots[pool]``). A slot of -1 inside a window the chunk needs raises."""
    window = model.config.window
    slots, lo, seen = _window_slots(pool.spec.name, window, inp)
    q, k, v = _qkv(model, p, h, inp)
    store = pool.buffer.dtype
    pool.buffer[0, layer, slots[inp.start :]] = k.to(store)
    pool.buffer[1, layer, slots[inp.start :]] = v.to(store)
    keys = pool.buffer[0, layer, seen].to(model.dtype)
    values = pool.buffer[1, layer, seen].to(model.dtype)
    return _attend(model, q, keys, values, inp, window, key_start=lo) @ p["wo"]


def _window_slots(
    name: str, window: int, inp: AttentionInputs
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The window pool's slots of positions ``0 .. end - 1``, the first position the chunk's
    window reaches, and the slots from there on (raises for a -1 there)."""
    slots = inp.pool_slots.get(name)
    end = inp.start + len(inp.positions)
    if slots is None or len(slots) != end:
        got = "none" if slots is None else f"{len(slots)}"
        raise ValueError(
            f"window layers need {end} {name!r} slots (positions 0..{end - 1}), got {got}"
        )
    lo = max(0, inp.start - window + 1)
    seen = slots[lo:end]
    if bool((seen < 0).any()):
        missing = (lo + torch.nonzero(seen < 0)[0]).item()
        raise RuntimeError(
            f"pool {name!r} holds no slot for position {missing}, inside the window of the "
            f"chunk at {inp.start}..{end - 1}"
        )
    return slots, lo, seen


def _qkv(
    model: TinyTransformer, p: dict[str, torch.Tensor], h: torch.Tensor, inp: AttentionInputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys (rotated) and values of the new tokens."""
    c = model.config
    n = h.shape[0]
    q = model.rope((h @ p["wq"]).view(n, c.heads, c.head_dim), inp.positions)
    k = model.rope((h @ p["wk"]).view(n, c.kv_heads, c.head_dim), inp.positions)
    v = (h @ p["wv"]).view(n, c.kv_heads, c.head_dim)
    return q, k, v


def latent_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pools: Mapping[str, DevicePool],
    layer: int,
    inp: AttentionInputs,
) -> torch.Tensor:
    """MLA: K and V are projected from a cached latent (DSA's sparse layers:
    :mod:`hicache.serving.model_sparse`)."""
    c = model.config
    n, total = h.shape[0], len(inp.slots)
    latent_pool = pools["latent"]
    latent_pool.buffer[0, layer, inp.new_slots] = (
        (h @ p["w_dkv"]).view(n, 1, -1).to(latent_pool.buffer.dtype)
    )
    latent = latent_pool.buffer[0, layer, inp.slots].to(model.dtype).view(total, -1)
    key_pos = torch.arange(total, device=h.device)
    k = model.rope((latent @ p["w_uk"]).view(total, c.heads, c.head_dim), key_pos)
    v = (latent @ p["w_uv"]).view(total, c.heads, c.head_dim)
    q = model.rope((h @ p["wq"]).view(n, c.heads, c.head_dim), inp.positions)
    return _attend(model, q, k, v, inp) @ p["wo"]


def recurrent_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pools: Mapping[str, DevicePool],
    layer: int,
    inp: AttentionInputs,
) -> torch.Tensor:
    """A Mamba-like layer: ``x = h @ w_in``; a causal depthwise convolution of width
    ``conv_kernel`` over ``x`` (its state: the last ``kernel - 1`` inputs, pool ``conv``);
    ``u = silu(conv)``; a per-channel state ``S`` (pool ``ssm``) updated per token as
    ``S = decay * S + u B_t^T`` and read as ``y = S C_t``; out ``y @ w_out``.

    The conv inputs and ``S`` are rounded to the pools' dtype at every step, so a state
    resumed from its slot (or from a snapshot) continues exactly as if computed through.
    """
    store = pools["conv"].buffer.dtype
    conv_state, state = _initial_state(model, pools, layer, inp)
    kernel = model.config.conv_kernel
    x = (h @ p["w_in"]).to(store).to(model.dtype)
    xs = torch.cat([conv_state, x])  # (kernel - 1 + n, inner): inputs from position start - k + 1
    n = x.shape[0]
    conv = xs[:n] * p["conv"][0]
    for k in range(1, kernel):  # in a fixed order: the same sums whatever the chunk
        conv = conv + xs[k : k + n] * p["conv"][k]
    u = torch.nn.functional.silu(conv)
    b, c = h @ p["w_b"], h @ p["w_c"]
    decay = p["decay"][:, None]
    snapshots = snapshots_by_step(inp.snapshots, inp.start, n)
    outs = []
    if 0 in snapshots:
        write_state(pools, layer, snapshots[0], xs[: kernel - 1], state)
    for t in range(n):
        state = (decay * state + u[t][:, None] * b[t][None, :]).to(store).to(model.dtype)
        outs.append(state @ c[t])
        if t + 1 in snapshots:
            write_state(pools, layer, snapshots[t + 1], xs[t + 1 : t + kernel], state)
    assert inp.state_slot is not None  # _initial_state checked it
    write_state(pools, layer, inp.state_slot, xs[n:], state)
    return torch.stack(outs) @ p["w_out"]


def _initial_state(
    model: TinyTransformer, pools: Mapping[str, DevicePool], layer: int, inp: AttentionInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv state (kernel - 1, inner), SSM state (inner, state_dim)) after ``inp.start``
    tokens: zeros at the start of a sequence, else the ``state_from`` slot's (a cached snapshot),
    else the working slot's."""
    c = model.config
    size = pools["conv"].size
    if inp.state_slot is None or not 0 <= inp.state_slot < size:
        raise ValueError(f"recurrent layers need a working state slot, got {inp.state_slot!r}")
    slot = inp.state_slot if inp.state_from is None else inp.state_from
    if not 0 <= slot < size:
        raise ValueError(f"state_from {slot!r} is not a slot of the state pools")
    if inp.start == 0:
        conv = torch.zeros(c.conv_kernel - 1, c.state_inner, dtype=model.dtype, device=model.device)
        return conv, torch.zeros(c.state_inner, c.state_dim, dtype=model.dtype, device=model.device)
    conv = pools["conv"].buffer[0, layer, slot].to(model.dtype)
    return conv, pools["ssm"].buffer[0, layer, slot].to(model.dtype)


def snapshots_by_step(snapshots: Mapping[int, int], start: int, n: int) -> dict[int, int]:
    """A chunk's snapshot slots (position -> slot) keyed by tokens computed in it (0 .. n)."""
    out = {}
    for position, slot in snapshots.items():
        if not start <= position <= start + n:
            raise ValueError(f"a snapshot at {position} is outside the chunk {start}..{start + n}")
        out[position - start] = slot
    return out


def write_state(
    pools: Mapping[str, DevicePool],
    layer: int,
    slot: int,
    conv: torch.Tensor,
    state: torch.Tensor,
) -> None:
    conv_pool, ssm_pool = pools["conv"], pools["ssm"]
    conv_pool.buffer[0, layer, slot] = conv.to(conv_pool.buffer.dtype)
    ssm_pool.buffer[0, layer, slot] = state.to(ssm_pool.buffer.dtype)
