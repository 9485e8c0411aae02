"""The dsv4 layers of the serving model (DeepSeek-V4-style hybrid attention): each attends to a
sliding window of raw K/V and to compressed entries, 4:1 and picked by an indexer (CSA) or 128:1
and all of them (HCA). See :func:`compressed_layer`; the other layer kinds are in
:mod:`hicache.serving.model_layers`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hicache.pools.device import DevicePool, pack_indexer, unpack_indexer
from hicache.serving.model_layers import (
    _FP8_MAX,
    AttentionInputs,
    _attend_masked,
    _qkv,
    _window_slots,
)
from hicache.serving.presets import DSV4_RATIOS, LayerKind, layer_group

if TYPE_CHECKING:
    from hicache.serving.model import TinyTransformer

__all__ = ["compressed_layer"]


def compressed_layer(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pools: Mapping[str, DevicePool],
    layers: Mapping[str, int],
    inp: AttentionInputs,
    kind: LayerKind,
) -> torch.Tensor:
    """A dsv4 layer: CSA (``COMPRESSED_SPARSE``, 4:1 entries picked by an indexer) or HCA
    (``HEAVILY_COMPRESSED``, 128:1 entries, all of them), each beside a sliding window.

    The new tokens' K/V go into the window pool (``swa``), as in a window layer. Then every group
    (4 tokens for CSA, 128 for HCA) whose last token is in the chunk is compressed: its K/V as
    stored in the window pool (the window is at least 128 tokens, so the whole group is still
    there, and the entry does not depend on how the prompt was chunked), flattened K then V,
    times ``w_comp``, rounded to the pool's dtype and spread over the group's anchor slots in
    ``c4`` / ``c128``. For CSA the entry's index key (``entry @ w_ik`` as fp8 with an fp32
    scale) goes to the ``indexer`` pool, spread likewise.

    A query at ``q`` attends in one softmax to the window ``(q - window, q]`` and to the entries
    of the groups complete at ``q`` (last token ``<= q``), projected to K (rotated at the group's
    last token) and V by ``w_uk`` / ``w_uv``: all of them for HCA; for CSA the
    ``index_topk_pages`` best by indexer score (``h @ w_iq`` against the stored keys; a tie goes
    to the earlier group). ``layers``: the layer's number in each pool. Everything attended to is
    read from the pools, so entries loaded from host or L3 read as computed ones."""
    c = model.config
    group = layer_group(kind)
    assert group is not None
    name, ratio = group
    swa, wl = pools["swa"], layers["swa"]
    slots, lo, seen = _window_slots("swa", c.window, inp)
    q, k, v = _qkv(model, p, h, inp)
    store = swa.buffer.dtype
    swa.buffer[0, wl, slots[inp.start :]] = k.to(store)
    swa.buffer[1, wl, slots[inp.start :]] = v.to(store)
    _compress_groups(model, p, pools, layers, inp, kind, slots)
    end = inp.start + len(inp.positions)
    count = end // ratio  # groups complete by the chunk's end
    pool = pools[name]
    entries = pool.buffer[0, layers[name], inp.slots[: count * ratio]].to(model.dtype)
    entries = entries.reshape(count, p["w_uk"].shape[0])
    entry_pos = torch.arange(1, count + 1, device=h.device) * ratio - 1  # last tokens
    shape = (count, c.kv_heads, c.head_dim)
    entry_k = model.rope((entries @ p["w_uk"]).view(shape), entry_pos)
    entry_v = (entries @ p["w_uv"]).view(shape)
    allowed = entry_pos[None, :] <= inp.positions[:, None]
    if kind is LayerKind.COMPRESSED_SPARSE:
        allowed = _top_entries(model, p, h, pools["indexer"], layers["indexer"], inp, allowed)
    key_pos = torch.arange(lo, end, device=h.device)[None, :]
    in_window = (key_pos <= inp.positions[:, None]) & (key_pos > inp.positions[:, None] - c.window)
    keys = torch.cat([swa.buffer[0, wl, seen].to(model.dtype), entry_k])
    values = torch.cat([swa.buffer[1, wl, seen].to(model.dtype), entry_v])
    mask = torch.cat([in_window, allowed], dim=1)
    return _attend_masked(q, keys, values, mask) @ p["wo"]


def _compress_groups(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    pools: Mapping[str, DevicePool],
    layers: Mapping[str, int],
    inp: AttentionInputs,
    kind: LayerKind,
    window_slots: torch.Tensor,
) -> None:
    """Write the entries (and for CSA the index keys) of the groups whose last token is in the
    chunk, from their K/V in the window pool (see :func:`compressed_layer`)."""
    group = layer_group(kind)
    assert group is not None
    name, ratio = group
    end = inp.start + len(inp.positions)
    first_group, stop_group = inp.start // ratio, end // ratio
    if stop_group <= first_group:
        return
    groups = stop_group - first_group
    span = slice(first_group * ratio, stop_group * ratio)
    swa = pools["swa"]
    kv = swa.buffer[:, layers["swa"], window_slots[span]].to(model.dtype)  # (2, tokens, Hk, D)
    flat = kv.reshape(2, groups, -1).transpose(0, 1).reshape(groups, -1)  # per group: K then V
    pool = pools[name]
    entry = (flat @ p["w_comp"]).to(pool.buffer.dtype)  # (groups, dim)
    pool.buffer[0, layers[name], inp.slots[span]] = entry.reshape(groups * ratio, -1)
    if kind is not LayerKind.COMPRESSED_SPARSE:
        return
    keys = entry.to(model.dtype) @ p["w_ik"]
    scale = keys.abs().amax(-1).clamp_min(1e-12) / _FP8_MAX
    fp8 = (keys / scale[:, None]).to(torch.float8_e4m3fn)
    packed = pack_indexer(fp8, scale.to(torch.float32))  # (groups, index_dim + 4)
    indexer = pools["indexer"]
    indexer.buffer[0, layers["indexer"], inp.slots[span]] = packed.reshape(groups * ratio, -1)


def _top_entries(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pool: DevicePool,
    layer: int,
    inp: AttentionInputs,
    complete: torch.Tensor,
) -> torch.Tensor:
    """Which C4 entries each query attends to: of those ``complete`` (n, groups) allows, the
    ``index_topk_pages`` with the highest indexer scores (stable: a tie to the earlier group),
    from the fp8 index keys cached over the group's slots."""
    n, count = complete.shape
    if count == 0:
        return complete
    ratio = DSV4_RATIOS[0]
    stored = pool.buffer[0, layer, inp.slots[: count * ratio]].reshape(count, -1)  # count > 0
    keys, scales = unpack_indexer(stored)
    cached = keys.to(model.dtype) * scales.to(model.dtype)[:, None]
    scores = ((h @ p["w_iq"]) @ cached.T).masked_fill(~complete, -math.inf)
    top = torch.argsort(scores, dim=-1, descending=True, stable=True)
    top = top[:, : min(model.config.index_topk_pages, count)]
    chosen = torch.zeros(n, count, dtype=torch.bool, device=h.device).scatter_(1, top, True)
    return chosen & complete
