"""The seeded model's dsv4 layers (DeepSeek-V4-style hybrid attention): each attends to a
sliding window of raw K/V (:mod:`hicache.models.window`) and to compressed entries, 4:1 and
picked by an indexer (CSA) or 128:1 and all of them (HCA). See :func:`compressed_layer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from hicache.errors import MissingSlotError
from hicache.models.attention import HeadSizes, attend, projected_heads
from hicache.models.config import DSV4_RATIOS, LayerKind, layer_group
from hicache.models.sparse import index_keys
from hicache.models.step import LayerContext, Step
from hicache.models.types import ChunkInput, DecodePages, DecodeRows
from hicache.models.window import window_read
from hicache.pools.device import DevicePool, unpack_indexer

__all__ = ["compressed_layer", "entry_pages", "start_hot_entries"]

Weights = Mapping[str, torch.Tensor]
Layers = Mapping[str, int]  # the layer's number in each pool it reads


def compressed_layer(
    ctx: LayerContext, w: Weights, h: torch.Tensor, step: Step, kind: LayerKind, layers: Layers
) -> torch.Tensor:
    """A dsv4 layer over each chunk of the step: CSA (``COMPRESSED_SPARSE``, 4:1 entries
    picked by an indexer) or HCA (``HEAVILY_COMPRESSED``, 128:1 entries, all of them), each
    beside a sliding window.

    The new tokens' K/V go into the window pool (``swa``), as in a window layer. Then every group
    (4 tokens for CSA, 128 for HCA) whose last token is in the chunk is compressed: its K/V as
    stored in the window pool (the window is at least 128 tokens, so the whole group is still
    there, and the entry does not depend on how the prompt was chunked), flattened K then V,
    through ``compress_proj``, rounded to the pool's dtype and spread over the group's slots
    in ``c4`` (the anchor's, ``ChunkInput.slots``) or ``c128`` (its own,
    ``ChunkInput.pool_slots``: a pool of its own lifecycle). For CSA the entry's index key
    (``indexer.k_proj`` of the entry as fp8 with an fp32 scale) goes to the ``indexer`` pool,
    on ``c4``'s slots, spread likewise.

    A query at ``q`` attends in one softmax to the window ``(q - window, q]`` and to the entries
    of the groups complete at ``q`` (last token ``<= q``), projected to K (rotated at the group's
    last token) and V by ``k_b_proj`` / ``v_b_proj``: all of them for HCA; for CSA the
    ``index_topk_pages`` best by indexer score (``indexer.q_proj`` of the token against the
    stored keys; a tie goes to the earlier group). ``layers``: the layer's number in each pool.
    Everything attended to is read from the pools, so entries loaded from host or L3 read as
    computed ones. A CSA decode token on the HiSparse buffer (``hot_row``) reads its index keys
    from the buffer's indexer and its chosen entries through the buffer's pages
    (:func:`start_hot_entries`, begun before its queries are computed, so the copies run
    meanwhile); its window and C128 entries come from their pools as above."""
    return torch.cat(
        [_chunk(ctx, w, h[rows], step, rows, chunk, layers, kind) for rows, chunk in step.each()]
    )


def _chunk(
    ctx: LayerContext,
    w: Weights,
    h: torch.Tensor,
    step: Step,
    rows: slice,
    chunk: ChunkInput,
    layers: Layers,
    kind: LayerKind,
) -> torch.Tensor:
    c, pools = ctx.config, step.pools
    group = layer_group(kind)
    assert group is not None
    name, ratio = group
    sizes, rotation = HeadSizes(c.heads, c.kv_heads, c.head_dim), step.rotation_of(rows)
    k, v = (projected_heads(w, h, x, sizes, rotation, 0.0) for x in "kv")
    window = window_read(pools["swa"], layers["swa"], chunk, (k, v), c.window, ctx.dtype)
    hot = step.hot if chunk.hot_row is not None and kind is LayerKind.COMPRESSED_SPARSE else None
    written = _compress_groups(ctx, w, pools, layers, chunk, kind, window.slots, hot)
    count = chunk.end // ratio  # groups complete by the chunk's end
    entry_pos = torch.arange(1, count + 1, device=h.device) * ratio - 1  # last tokens
    allowed = entry_pos[None, :] <= chunk.positions[:, None]
    stored_of = None
    if kind is LayerKind.COMPRESSED_SPARSE:
        index = pools["indexer"].buffer if hot is None else hot.index
        allowed, top = _top_entries(ctx, w, h, index, layers["indexer"], chunk, allowed)
        if hot is not None:  # its pages' copies run while the queries are computed
            stored_of = start_hot_entries(ctx, hot, layers[name], chunk, top, written)
    q = projected_heads(w, h, "q", sizes, rotation, 0.0)
    if stored_of is None:
        stored = pools[name].buffer[0, layers[name], _entry_slots(chunk, name, count * ratio)]
    else:
        stored = stored_of()
    k_b = w["self_attn.k_b_proj.weight"]
    entries = stored.to(ctx.dtype).reshape(count, k_b.shape[1])
    shape = (count, c.kv_heads, c.head_dim)
    entry_k = ctx.rope(F.linear(entries, k_b).view(shape), entry_pos)
    entry_v = F.linear(entries, w["self_attn.v_b_proj.weight"]).view(shape)
    keys = torch.cat([window.keys, entry_k])
    values = torch.cat([window.values, entry_v])
    mask = torch.cat([window.mask, allowed], dim=1)
    mixed = attend(q[None], keys[None], values[None], mask[None, None])[0]
    return F.linear(mixed, w["self_attn.o_proj.weight"])


def _entry_slots(chunk: ChunkInput, name: str, stop: int) -> torch.Tensor:
    """The slots of compressed pool ``name`` for positions ``0 .. stop - 1``: its own where the
    chunk carries them (``c128``; MissingSlotError for a -1 there), else the anchor's (``c4``)."""
    own = chunk.pool_slots.get(name)
    if own is None:
        return chunk.slots[:stop]
    slots = own[:stop]
    if len(slots) < stop or bool((slots < 0).any()):
        raise MissingSlotError(f"pool {name!r} holds no slot for a position below {stop}")
    return slots


def _compress_groups(
    ctx: LayerContext,
    w: Weights,
    pools: Mapping[str, DevicePool],
    layers: Layers,
    chunk: ChunkInput,
    kind: LayerKind,
    window_slots: torch.Tensor,
    hot: DecodePages | None,
) -> torch.Tensor:
    """Write the entries (and for CSA the index keys) of the groups whose last token is in the
    chunk, from their K/V in the window pool (see :func:`compressed_layer`); returns them
    spread over their slots ((groups x ratio, *item), maybe none). A decode token on the
    HiSparse ``hot`` buffer writes its index key to the buffer's indexer (``chunk.slots`` are
    its slots there) and leaves its C4 entry to :func:`start_hot_entries`, which writes it to the
    buffer and host."""
    group = layer_group(kind)
    assert group is not None
    name, ratio = group
    first_group, stop_group = chunk.start // ratio, chunk.end // ratio
    if stop_group <= first_group:
        return pools[name].buffer.new_empty((0, *pools[name].buffer.shape[3:]))
    groups = stop_group - first_group
    span = slice(first_group * ratio, stop_group * ratio)
    swa = pools["swa"]
    kv = swa.buffer[:, layers["swa"], window_slots[span]].to(ctx.dtype)  # (2, tokens, Hk, D)
    flat = kv.reshape(2, groups, -1).transpose(0, 1).reshape(groups, -1)  # per group: K then V
    pool = pools[name]
    entry = F.linear(flat, w["self_attn.compress_proj.weight"]).to(pool.buffer.dtype)
    spread = entry.reshape(groups * ratio, -1)
    if hot is None:
        pool.buffer[0, layers[name], _entry_slots(chunk, name, span.stop)[span]] = spread
    if kind is not LayerKind.COMPRESSED_SPARSE:
        return spread
    packed = index_keys(F.linear(entry.to(ctx.dtype), w["indexer.k_proj.weight"]))
    index = pools["indexer"].buffer if hot is None else hot.index
    index[0, layers["indexer"], chunk.slots[span]] = packed.reshape(groups * ratio, -1)
    return spread


def _top_entries(
    ctx: LayerContext,
    w: Weights,
    h: torch.Tensor,
    index: torch.Tensor,
    layer: int,
    chunk: ChunkInput,
    complete: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which C4 entries each query attends to: of those ``complete`` (n, groups) allows, the
    ``index_topk_pages`` with the highest indexer scores (stable: a tie to the earlier group),
    from the fp8 index keys cached over the group's slots of ``index`` (the indexer pool's
    buffer, or the HiSparse buffer's indexer). Returns the mask (n, groups) and the top
    entries' numbers (n, min(k, groups)), best first."""
    n, count = complete.shape
    if count == 0:
        return complete, complete.new_empty((n, 0), dtype=torch.int64)
    ratio = DSV4_RATIOS[0]
    stored = index[0, layer, chunk.slots[: count * ratio]].reshape(count, -1)  # count > 0
    keys, scales = unpack_indexer(stored)
    cached = keys.to(ctx.dtype) * scales.to(ctx.dtype)[:, None]
    iq = F.linear(h, w["indexer.q_proj.weight"])
    scores = (iq @ cached.T).masked_fill(~complete, -math.inf)
    top = torch.argsort(scores, dim=-1, descending=True, stable=True)
    top = top[:, : min(ctx.config.index_topk_pages, count)]
    chosen = torch.zeros(n, count, dtype=torch.bool, device=h.device).scatter_(1, top, True)
    return chosen & complete, top


def entry_pages(entries: torch.Tensor, own: int, page_size: int, width: int) -> torch.Tensor:
    """The pages (1, ``width``) a decode token at page ``own`` wants from the hot buffer for
    its top C4 ``entries`` (k,): its own page first, then the others' distinct pages in
    ascending order, -1 after them. Fixed shapes throughout (sort, compare, no ``unique`` or
    ``nonzero``), so on CUDA nothing here waits for the device."""
    ratio = DSV4_RATIOS[0]  # an entry's 4 slots lie on one page: 4 divides the page size
    pages = entries * ratio // page_size
    beyond = own + 1  # sorts after every real page
    pages = torch.sort(torch.where(pages == own, beyond, pages)).values
    repeat = torch.zeros_like(pages, dtype=torch.bool)
    repeat[1:] = pages[1:] == pages[:-1]
    pages = torch.sort(torch.where(repeat, beyond, pages)).values  # distinct first
    wanted = pages.new_full((1, width), -1)
    wanted[0, 0] = own
    rest = pages[: width - 1]
    wanted[0, 1 : 1 + len(rest)] = torch.where(rest == beyond, -1, rest)
    return wanted


def start_hot_entries(
    ctx: LayerContext,
    hot: DecodePages,
    layer: int,
    chunk: ChunkInput,
    top: torch.Tensor,
    written: torch.Tensor,
) -> Callable[[], torch.Tensor]:
    """A decode token's C4 entries through the HiSparse buffer (``hot``, C4 ``layer``): the
    pages of its ``top`` entries (1, k), its own page first (where its new entry's slots
    ``written`` go, to the buffer and host), brought in by the buffer's fused step and copies,
    begun now; the returned callable waits for them and reads each chosen entry's slots.
    (groups x 4, *item) in the pool's dtype, zeros where an entry is not chosen: those are
    masked, so attention computes on the same bytes as it does from the C4 pool."""
    assert chunk.hot_row is not None
    ratio, ps, device = DSV4_RATIOS[0], ctx.config.page_size, top.device
    own, groups = chunk.start // ps, chunk.end // ratio
    # the top-k entries lie on at most as many pages, beside the own page, and on no more than
    # the context has: what HiSparseConfig.check lets the buffer hold
    width = min(ctx.config.index_topk_pages + 1, own + 1)
    wanted = entry_pages(top[0], own, ps, width)
    rows = DecodeRows(
        [0],
        torch.zeros(1, dtype=torch.int64, device=device),
        chunk.positions[-1:],
        chunk.slots[None],
        torch.tensor([chunk.hot_row], dtype=torch.int64),
    )
    latent_of = hot.start_gather(layer, rows, wanted, written.reshape(1, -1))
    tokens = (top[0, :, None] * ratio + torch.arange(ratio, device=device)).flatten()
    # where each chosen token is in the gathered pages: its page's place in ``wanted``
    place = (tokens[:, None] // ps == wanted[0][None, :]).to(torch.int64).argmax(1)
    source = place * ps + tokens % ps

    def entries() -> torch.Tensor:
        latent = latent_of()  # (1, width x ps, item)
        out = latent.new_zeros((groups * ratio, latent.shape[-1]))
        out[tokens] = latent[0, source]
        return out

    return entries
