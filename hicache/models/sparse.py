"""DSA layers computed sparsely: an fp8 indexer scores every cached token, each query keeps its
top-k pages (its own page always), and attention gathers only those pages' latent and computes
in the latent space (MLA's absorbed form, with DeepSeek's decoupled rotary key).

A prefill chunk's queries each gather their own pages (in blocks of queries); decode
tokens (chunks of one token) of all running requests go through one batched path:
their indexer scores, top-k pages, latent gather and attention are single tensor operations over
the batch. Where a decode row's latent comes from is a :class:`DecodePages`: the anchor pool
through the request's slots (:class:`AnchorPages`), or a HiSparse hot buffer over host memory
(:class:`hicache.sparse.hot_buffer.HotBuffer`). Both hand the same bytes to the same arithmetic,
so given the same pages the outputs are the same. A decode layer starts the gather
(``start_gather``: the hot buffer's fused step and its copies) before it computes its queries
and takes the pages after, so the hot buffer's copies overlap that work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from hicache.errors import InvalidArgumentError
from hicache.models.step import LayerContext, Step
from hicache.models.types import ChunkInput, DecodePages, DecodeRows
from hicache.pools.device import DevicePool, indexer_as_float, pack_indexer, take_rows

__all__ = [
    "AnchorPages",
    "index_keys",
    "rope_dim",
    "sparse_latent_layer",
    "top_pages",
]

Weights = Mapping[str, torch.Tensor]
_FP8_MAX = 448.0  # largest float8_e4m3fn value
_PREFILL_BLOCK = 256  # prefill queries whose pages are gathered at once


class AnchorPages:
    """Decode rows whose context is in the anchor pools: latent and indexer on the same slots."""

    def __init__(self, pools: Mapping[str, DevicePool], page_size: int) -> None:
        self._latent = pools["latent"].buffer
        self._index = pools["indexer"].buffer
        self._page_size = page_size

    @property
    def index(self) -> torch.Tensor:
        return self._index

    def start_gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        gathered = self.gather(layer, rows, top, latent_new)  # nothing to copy: at once
        return lambda: gathered

    def gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> torch.Tensor:
        latent = self._latent[0, layer]
        latent[rows.new_slots] = latent_new.view(len(top), 1, -1).to(latent.dtype)
        key_pos, _ = _page_positions(top, rows.positions, self._page_size)
        slots = rows.slots.gather(1, key_pos.clamp_max(rows.slots.shape[1] - 1))
        # positions past a row's end: masked by the caller
        return take_rows(latent, slots).flatten(2)


def top_pages(
    scores: torch.Tensor, positions: torch.Tensor, page_size: int, k: int
) -> torch.Tensor:
    """Each query's top-``k`` pages by its best token score (its own page first), from scores
    (n, T) over token positions ``0 .. T-1``; tokens after a query's position never count.
    (n, min(k, pages)) int64 page indices, -1 where a query has fewer pages."""
    n, total = scores.shape
    key_pos = torch.arange(total, device=scores.device)
    scores = scores.masked_fill(key_pos[None, :] > positions[:, None], -math.inf)
    n_pages = -(-total // page_size)
    padded = scores.new_full((n, n_pages * page_size), -math.inf)
    padded[:, :total] = scores
    page_scores = padded.view(n, n_pages, page_size).amax(-1)
    page_scores.scatter_(1, (positions // page_size)[:, None], math.inf)
    order = torch.argsort(page_scores, dim=-1, descending=True, stable=True)
    top = order[:, : min(k, n_pages)]
    valid = torch.gather(page_scores, 1, top) > -math.inf
    return torch.where(valid, top, torch.full_like(top, -1))


def index_keys(keys: torch.Tensor) -> torch.Tensor:
    """Index keys (n, D) quantized for the indexer pool: fp8 keys scaled by their absolute
    maximum, packed with their fp32 scales."""
    scale = keys.abs().amax(-1).clamp_min(1e-12) / _FP8_MAX
    fp8 = (keys / scale[:, None]).to(torch.float8_e4m3fn)
    return pack_indexer(fp8, scale.to(torch.float32))


def _index_scores(packed: torch.Tensor, iq: torch.Tensor) -> torch.Tensor:
    """Indexer scores of queries ``iq`` ((n, D), or (B, D) with ``packed`` (B, T, ...)) over
    cached fp8 keys ``packed`` ((T, ...) or (B, T, ...)): (n, T) or (B, T). Each key's scale is
    applied after its dot product, one multiply per token instead of one per element."""
    keys, scales = indexer_as_float(packed, iq.dtype)
    if keys.dim() == 2:
        return (iq @ keys.T) * scales
    return torch.bmm(keys, iq[:, :, None])[:, :, 0] * scales


def rope_dim(latent_dim: int) -> int:
    """The dims at the end of a DSA latent that are its rotary key, shared by every head
    (DeepSeek's decoupled RoPE: 64 of its 576): an eighth of the latent, even, at least 2."""
    return max(2, latent_dim // 16 * 2)


def _queries(
    ctx: LayerContext, w: Weights, h: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the query absorbed into the latent (``k_b_proj`` folded in: (n, H,
    latent - R)) and its rotated rotary part ((n, H, R))."""
    c = ctx.config
    n, r = h.shape[0], rope_dim(c.latent_dim)
    q = F.linear(h, w["self_attn.q_proj.weight"]).view(n, c.heads, c.head_dim)
    w_uk = w["self_attn.k_b_proj.weight"].T.view(-1, c.heads, c.head_dim)  # (latent - R, H, D)
    absorbed = torch.einsum("nhd,lhd->nhl", q, w_uk)
    q_rope = F.linear(h, w["self_attn.q_rope_proj.weight"]).view(n, c.heads, r)
    return absorbed, ctx.latent_rope(q_rope, pos[:, None])


def _attend_latent(
    ctx: LayerContext,
    w: Weights,
    queries: tuple[torch.Tensor, torch.Tensor],
    latent: torch.Tensor,
    key_pos: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Attention of B x n queries over B x T cached latents (B, T, latent) at ``key_pos`` (B, T)
    where ``mask`` (B, n, T) allows, computed in the latent space (MLA's absorbed form: K and V
    are never materialized); (B, n, hidden) after ``o_proj``."""
    c = ctx.config
    r = rope_dim(c.latent_dim)
    absorbed, q_rope = queries  # (B, n, H, L - R), (B, n, H, R)
    nope = latent[..., :-r]
    k_rope = ctx.latent_rope(latent[..., -r:], key_pos)
    scores = torch.einsum("bnhl,btl->bhnt", absorbed, nope)
    scores = scores + torch.einsum("bnhr,btr->bhnt", q_rope, k_rope)
    scores = scores / math.sqrt(c.head_dim + r)
    probs = torch.softmax(scores.masked_fill(~mask[:, None], -math.inf), dim=-1)
    mixed = torch.einsum("bhnt,btl->bnhl", probs, nope)  # values, still in the latent space
    w_uv = w["self_attn.v_b_proj.weight"].T.view(-1, c.heads, c.head_dim)
    out = torch.einsum("bnhl,lhd->bnhd", mixed, w_uv)
    b, n = out.shape[:2]
    return F.linear(out.reshape(b, n, c.heads * c.head_dim), w["self_attn.o_proj.weight"])


def _sparse_prefill(
    ctx: LayerContext,
    w: Weights,
    h: torch.Tensor,
    pools: Mapping[str, DevicePool],
    layer: int,
    chunk: ChunkInput,
) -> torch.Tensor:
    """One request's chunk: cache its latent and indexer keys, then let each query attend
    over its own top-k pages."""
    c, ps = ctx.config, ctx.config.page_size
    latent_pool, index_pool = pools["latent"].buffer, pools["indexer"].buffer
    n = h.shape[0]
    latent = F.linear(h, w["self_attn.kv_a_proj.weight"]).view(n, 1, -1)
    latent_pool[0, layer, chunk.new_slots] = latent.to(latent_pool.dtype)
    index_pool[0, layer, chunk.new_slots] = index_keys(F.linear(h, w["indexer.k_proj.weight"]))
    iq = F.linear(h, w["indexer.q_proj.weight"])
    scores = _index_scores(index_pool[0, layer, chunk.slots], iq)
    top = top_pages(scores, chunk.positions, ps, c.index_topk_pages)
    # Each query gathers its own pages (a union over a long chunk's queries covers most of the
    # context), in blocks that bound the gathered latent's size.
    absorbed, q_rope = _queries(ctx, w, h, chunk.positions)
    outs = []
    for lo in range(0, n, _PREFILL_BLOCK):
        rows = slice(lo, lo + _PREFILL_BLOCK)
        key_pos, valid = _page_positions(top[rows], chunk.positions[rows], ps)
        slots = chunk.slots[key_pos.clamp_max(len(chunk.slots) - 1)]
        gathered = latent_pool[0, layer, slots].flatten(2).to(ctx.dtype)
        queries = (absorbed[rows, None], q_rope[rows, None])
        outs.append(_attend_latent(ctx, w, queries, gathered, key_pos, valid[:, None])[:, 0])
    return torch.cat(outs)


def _page_positions(
    top: torch.Tensor, positions: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token positions of each row's pages (B, K * page_size), and which of them it may
    attend to (a real page, at or before the row's position)."""
    offsets = torch.arange(page_size, device=top.device)
    key_pos = (top.clamp_min(0)[:, :, None] * page_size + offsets).flatten(1)
    valid = (top >= 0).repeat_interleave(page_size, dim=1) & (key_pos <= positions[:, None])
    return key_pos, valid


def _sparse_decode(
    ctx: LayerContext,
    w: Weights,
    h: torch.Tensor,
    layer: int,
    rows: DecodeRows,
    pages: DecodePages,
) -> torch.Tensor:
    """One new token of each of B requests (``h``: (B, hidden)) as one batch: (B, hidden)."""
    c, ps = ctx.config, ctx.config.page_size
    pos = rows.positions
    index = pages.index[0, layer]
    index[rows.new_slots] = index_keys(F.linear(h, w["indexer.k_proj.weight"]))
    iq = F.linear(h, w["indexer.q_proj.weight"])
    scores = _index_scores(take_rows(index, rows.slots), iq)  # (B, T)
    top = top_pages(scores, pos, ps, c.index_topk_pages)
    new_latent = F.linear(h, w["self_attn.kv_a_proj.weight"])
    # The pages' copies run (HiSparse) while the queries are computed; waited for after.
    latent_of = pages.start_gather(layer, rows, top, new_latent)
    key_pos, valid = _page_positions(top, pos, ps)
    absorbed, q_rope = _queries(ctx, w, h, pos)
    queries = (absorbed[:, None], q_rope[:, None])
    latent = latent_of().to(ctx.dtype)
    return _attend_latent(ctx, w, queries, latent, key_pos, valid[:, None])[:, 0]


def sparse_latent_layer(
    ctx: LayerContext, w: Weights, h: torch.Tensor, step: Step, layer: int
) -> torch.Tensor:
    """A DSA layer's token mixing for every chunk of a step: one-token chunks batched per page
    source (the hot buffer for rows with a ``hot_row``, else the anchor pools), longer ones
    per request."""
    outs: list[torch.Tensor | None] = [None] * len(step.chunks)
    for rows in step.decode_groups:
        anchor = rows.hot_rows is None
        source = AnchorPages(step.pools, ctx.config.page_size) if anchor else step.hot
        if source is None:
            raise InvalidArgumentError("chunks with a hot_row need the HiSparse hot buffer")
        out = _sparse_decode(ctx, w, h[rows.token_rows], layer, rows, source)
        for row, i in enumerate(rows.chunks):
            outs[i] = out[row : row + 1]
    for i, (rows_of, chunk) in enumerate(step.each()):
        if outs[i] is None:
            outs[i] = _sparse_prefill(ctx, w, h[rows_of], step.pools, layer, chunk)
    return torch.cat([out for out in outs if out is not None])
