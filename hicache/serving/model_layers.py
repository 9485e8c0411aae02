"""The layer kinds of the serving model: each writes the new tokens' state into its pool, then
reads the whole context back from the pool (see :mod:`hicache.serving.model`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicache.pools.device import DevicePool, pack_indexer, unpack_indexer
from hicache.serving.presets import LayerKind

if TYPE_CHECKING:
    from hicache.serving.model import TinyTransformer

__all__ = ["AttentionInputs", "attention_layer", "latent_layer", "recurrent_layer"]

_FP8_MAX = 448.0  # largest float8_e4m3fn value


@dataclass(slots=True)
class AttentionInputs:
    slots: torch.Tensor  # (T,) slots of positions 0 .. T-1
    start: int  # first new position
    positions: torch.Tensor  # (n,) new positions

    @property
    def new_slots(self) -> torch.Tensor:
        return self.slots[self.start :]


def _attend(
    model: TinyTransformer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inp: AttentionInputs,
    window: int | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries (n, H, D) over keys and values (T, Hk, D); (n, H*D)."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(n, kv_heads, heads // kv_heads, dim)  # query heads sharing a KV head
    scores = torch.einsum("nkgd,tkd->kgnt", grouped, k) / math.sqrt(dim)
    key_pos = torch.arange(k.shape[0], device=q.device)
    mask = key_pos[None, :] <= inp.positions[:, None]
    if window is not None:
        mask &= key_pos[None, :] > inp.positions[:, None] - window
    if allowed is not None:
        mask &= allowed
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return torch.einsum("kgnt,tkd->nkgd", probs, v).reshape(n, heads * dim)


def attention_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pool: DevicePool,
    layer: int,
    inp: AttentionInputs,
    kind: LayerKind,
) -> torch.Tensor:
    """GQA attention (a window of ``config.window`` tokens for WINDOW layers)."""
    c = model.config
    n = h.shape[0]
    q = model.rope((h @ p["wq"]).view(n, c.heads, c.head_dim), inp.positions)
    k = model.rope((h @ p["wk"]).view(n, c.kv_heads, c.head_dim), inp.positions)
    v = (h @ p["wv"]).view(n, c.kv_heads, c.head_dim)
    store = pool.buffer.dtype
    pool.buffer[0, layer, inp.new_slots] = k.to(store)
    pool.buffer[1, layer, inp.new_slots] = v.to(store)
    keys = pool.buffer[0, layer, inp.slots].to(model.dtype)
    values = pool.buffer[1, layer, inp.slots].to(model.dtype)
    window = c.window if kind is LayerKind.WINDOW else None
    return _attend(model, q, keys, values, inp, window) @ p["wo"]


def latent_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pools: Mapping[str, DevicePool],
    layer: int,
    inp: AttentionInputs,
    kind: LayerKind,
) -> torch.Tensor:
    """MLA: K and V are projected from a cached latent; DSA adds page selection by an indexer."""
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
    allowed = None
    if kind is LayerKind.SPARSE_LATENT:
        allowed = _indexer_pages(model, p, h, pools["indexer"], layer, inp)
    return _attend(model, q, k, v, inp, None, allowed) @ p["wo"]


def _indexer_pages(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pool: DevicePool,
    layer: int,
    inp: AttentionInputs,
) -> torch.Tensor:
    """Which context tokens each query may attend to: those of its top-k pages by indexer score
    (its own page always), from fp8 indexer keys cached per token."""
    c = model.config
    n, total, ps = h.shape[0], len(inp.slots), c.page_size
    keys = h @ p["w_ik"]
    scale = keys.abs().amax(-1).clamp_min(1e-12) / _FP8_MAX
    fp8 = (keys / scale[:, None]).to(torch.float8_e4m3fn)
    pool.buffer[0, layer, inp.new_slots] = pack_indexer(fp8, scale.to(torch.float32))
    stored, scales = unpack_indexer(pool.buffer[0, layer, inp.slots])
    cached_keys = stored.to(model.dtype) * scales.to(model.dtype)[:, None]
    scores = (h @ p["w_iq"]) @ cached_keys.T  # (n, T)
    key_pos = torch.arange(total, device=h.device)
    scores = scores.masked_fill(key_pos[None, :] > inp.positions[:, None], -math.inf)
    n_pages = -(-total // ps)
    padded = torch.full((n, n_pages * ps), -math.inf, dtype=scores.dtype, device=h.device)
    padded[:, :total] = scores
    page_scores = padded.view(n, n_pages, ps).amax(-1)
    own = (inp.positions // ps)[:, None]
    page_scores.scatter_(1, own, math.inf)
    top = torch.argsort(page_scores, dim=-1, descending=True, stable=True)
    top = top[:, : min(c.index_topk_pages, n_pages)]
    chosen = torch.zeros(n, n_pages, dtype=torch.bool, device=h.device).scatter_(1, top, True)
    chosen &= page_scores > -math.inf
    return chosen[:, key_pos // ps]


def recurrent_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pool: DevicePool,
    layer: int,
    inp: AttentionInputs,
) -> torch.Tensor:
    """A diagonal linear recurrence; the state after every token is cached in its slot, rounded
    to the pool's dtype at each step so that resuming from a cached state is exact."""
    inputs = h @ p["w_in"]
    store = pool.buffer.dtype
    if inp.start > 0:
        state = pool.buffer[0, layer, inp.slots[inp.start - 1]].to(model.dtype)
    else:
        state = torch.zeros(inputs.shape[1], dtype=model.dtype, device=h.device)
    decay = p["decay"]
    states = []
    for t in range(inputs.shape[0]):
        state = (decay * state + inputs[t]).to(store).to(model.dtype)
        states.append(state)
    stacked = torch.stack(states)
    pool.buffer[0, layer, inp.new_slots] = stacked.to(store)
    return stacked @ p["w_out"]
