"""DSA layers computed sparsely: an fp8 indexer scores every cached token, each query keeps its
top-k pages (its own page always), and attention gathers only those pages' latent and computes
in the latent space (MLA's absorbed form, with DeepSeek's decoupled rotary key).

A prefill chunk's queries each gather their own pages (in blocks of queries); decode
tokens (chunks of one token) of all running requests go through one batched path:
their indexer scores, top-k pages, latent gather and attention are single tensor operations over
the batch. Where a decode row's latent comes from is a :class:`DecodePages`: the anchor pool
through the request's slots (:class:`AnchorPages`), or a HiSparse hot buffer over host memory
(:class:`hicache.sparse.hot_buffer.HotBuffer`). Both hand the same bytes to the same arithmetic,
so given the same pages the outputs are the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from hicache.pools.device import DevicePool, indexer_as_float, pack_indexer, take_rows
from hicache.serving.model_layers import _FP8_MAX, AttentionInputs, rotate

if TYPE_CHECKING:
    from hicache.serving.model import TinyTransformer

__all__ = [
    "AnchorPages",
    "DecodePages",
    "DecodeRows",
    "decode_rows",
    "rope_dim",
    "sparse_latent_outputs",
    "top_pages",
]


_PREFILL_BLOCK = 256  # prefill queries whose pages are gathered at once


@dataclass(slots=True)
class DecodeRows:
    """The one-token chunks of a step that read their latent from one place, as tensors built
    once per step: which chunks they are, their token's row in the step's hidden states, the
    new token's position, the slots of every position up to it (padded with slot 0), and
    their hot buffer rows (HiSparse)."""

    chunks: list[int]
    token_rows: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,)
    slots: torch.Tensor  # (B, T)
    hot_rows: torch.Tensor | None = None  # (B,)

    @property
    def new_slots(self) -> torch.Tensor:
        return self.slots.gather(1, self.positions[:, None])[:, 0]


def decode_rows(inputs: Sequence[AttentionInputs], bounds: Sequence[int]) -> list[DecodeRows]:
    """The step's one-token chunks, grouped by where their latent is: the anchor pools, or the
    hot buffer (chunks with a ``hot_row``)."""
    groups: dict[bool, list[int]] = {False: [], True: []}
    for i, inp in enumerate(inputs):
        if bounds[i + 1] - bounds[i] == 1:
            groups[inp.hot_row is not None].append(i)
    out = []
    for in_hot, chunks in groups.items():
        if not chunks:
            continue
        picked = [inputs[i] for i in chunks]
        device = picked[0].slots.device
        slots = torch.nn.utils.rnn.pad_sequence([inp.slots for inp in picked], batch_first=True)
        hot_rows = [inp.hot_row for inp in picked] if in_hot else None
        out.append(
            DecodeRows(
                chunks,
                torch.tensor([bounds[i] for i in chunks], device=device),
                torch.tensor([inp.start for inp in picked], device=device),
                slots,
                None if hot_rows is None else torch.tensor(hot_rows, dtype=torch.int64),
            )
        )
    return out


class DecodePages(Protocol):
    """Where batched decode rows keep their cached state: indexer keys by slot (``index``, a
    ``(1, layers, slots, item)`` uint8 tensor, read at the rows' ``slots``), and their latent,
    reached by page."""

    @property
    def index(self) -> torch.Tensor: ...

    def gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> torch.Tensor:
        """Store each row's new latent (``latent_new``: (B, latent_dim), at ``rows.positions``),
        then return the latent of the tokens of the pages ``top`` (B, K) names, (B, K *
        page_size, latent_dim) in the pool dtype (anything where ``top`` is -1)."""
        ...


class AnchorPages:
    """Decode rows whose context is in the anchor pools: latent and indexer on the same slots."""

    def __init__(self, pools: Mapping[str, DevicePool], page_size: int) -> None:
        self._latent = pools["latent"].buffer
        self._index = pools["indexer"].buffer
        self._page_size = page_size

    @property
    def index(self) -> torch.Tensor:
        return self._index

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


def _index_keys(
    model: TinyTransformer, p: dict[str, torch.Tensor], h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' indexer keys, packed for the pool (fp8 + fp32 scale)."""
    keys = h @ p["w_ik"]
    scale = keys.abs().amax(-1).clamp_min(1e-12) / _FP8_MAX
    fp8 = (keys / scale[:, None]).to(torch.float8_e4m3fn)
    return pack_indexer(fp8, scale.to(torch.float32)), h @ p["w_iq"]


def _index_scores(model: TinyTransformer, packed: torch.Tensor, iq: torch.Tensor) -> torch.Tensor:
    """Indexer scores of queries ``iq`` ((n, D), or (B, D) with ``packed`` (B, T, ...)) over
    cached fp8 keys ``packed`` ((T, ...) or (B, T, ...)): (n, T) or (B, T). Each key's scale is
    applied after its dot product, one multiply per token instead of one per element."""
    keys, scales = indexer_as_float(packed, model.dtype)
    if keys.dim() == 2:
        return (iq @ keys.T) * scales
    return torch.bmm(keys, iq[:, :, None])[:, :, 0] * scales


def rope_dim(latent_dim: int) -> int:
    """The dims at the end of a DSA latent that are its rotary key, shared by every head
    (DeepSeek's decoupled RoPE: 64 of its 576): an eighth of the latent, even, at least 2."""
    return max(2, latent_dim // 16 * 2)


def _queries(
    model: TinyTransformer, p: dict[str, torch.Tensor], h: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the query absorbed into the latent (``w_uk`` folded in: (n, H, latent - R))
    and its rotated rotary part ((n, H, R))."""
    c = model.config
    n, r = h.shape[0], rope_dim(c.latent_dim)
    q = (h @ p["wq"]).view(n, c.heads, c.head_dim)
    w_uk = p["w_uk"].view(-1, c.heads, c.head_dim)  # (latent - R, H, D)
    absorbed = torch.einsum("nhd,lhd->nhl", q, w_uk)
    q_rope = rotate((h @ p["w_qr"]).view(n, c.heads, r), pos[:, None], model.latent_rope_freq)
    return absorbed, q_rope


def _attend_latent(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    queries: tuple[torch.Tensor, torch.Tensor],
    latent: torch.Tensor,
    key_pos: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Attention of B x n queries over B x T cached latents (B, T, latent) at ``key_pos`` (B, T)
    where ``mask`` (B, n, T) allows, computed in the latent space (MLA's absorbed form: K and V
    are never materialized); (B, n, hidden) after ``wo``."""
    c = model.config
    r = rope_dim(c.latent_dim)
    absorbed, q_rope = queries  # (B, n, H, L - R), (B, n, H, R)
    nope = latent[..., :-r]
    k_rope = rotate(latent[..., -r:], key_pos, model.latent_rope_freq)
    scores = torch.einsum("bnhl,btl->bhnt", absorbed, nope)
    scores = scores + torch.einsum("bnhr,btr->bhnt", q_rope, k_rope)
    scores = scores / math.sqrt(c.head_dim + r)
    probs = torch.softmax(scores.masked_fill(~mask[:, None], -math.inf), dim=-1)
    mixed = torch.einsum("bhnt,btl->bnhl", probs, nope)  # values, still in the latent space
    w_uv = p["w_uv"].view(-1, c.heads, c.head_dim)
    out = torch.einsum("bnhl,lhd->bnhd", mixed, w_uv)
    b, n = out.shape[:2]
    return out.reshape(b, n, c.heads * c.head_dim) @ p["wo"]


def sparse_prefill(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    pools: Mapping[str, DevicePool],
    layer: int,
    inp: AttentionInputs,
) -> torch.Tensor:
    """One request's chunk: cache its latent and indexer keys, then let each query attend
    over its own top-k pages."""
    c, ps = model.config, model.config.page_size
    latent_pool, index_pool = pools["latent"].buffer, pools["indexer"].buffer
    n = h.shape[0]
    latent_pool[0, layer, inp.new_slots] = (h @ p["w_dkv"]).view(n, 1, -1).to(latent_pool.dtype)
    packed, iq = _index_keys(model, p, h)
    index_pool[0, layer, inp.new_slots] = packed
    scores = _index_scores(model, index_pool[0, layer, inp.slots], iq)
    top = top_pages(scores, inp.positions, ps, c.index_topk_pages)
    # Each query gathers its own pages (a union over a long chunk's queries covers most of the
    # context), in blocks that bound the gathered latent's size.
    absorbed, q_rope = _queries(model, p, h, inp.positions)
    outs = []
    for lo in range(0, n, _PREFILL_BLOCK):
        rows = slice(lo, lo + _PREFILL_BLOCK)
        key_pos, valid = _page_positions(top[rows], inp.positions[rows], ps)
        slots = inp.slots[key_pos.clamp_max(len(inp.slots) - 1)]
        latent = latent_pool[0, layer, slots].flatten(2).to(model.dtype)
        queries = (absorbed[rows, None], q_rope[rows, None])
        outs.append(_attend_latent(model, p, queries, latent, key_pos, valid[:, None])[:, 0])
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


def sparse_decode(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    layer: int,
    rows: DecodeRows,
    pages: DecodePages,
) -> torch.Tensor:
    """One new token of each of B requests (``h``: (B, hidden)) as one batch: (B, hidden)."""
    c, ps = model.config, model.config.page_size
    pos = rows.positions
    packed, iq = _index_keys(model, p, h)
    index = pages.index[0, layer]
    index[rows.new_slots] = packed
    scores = _index_scores(model, take_rows(index, rows.slots), iq)  # (B, T)
    top = top_pages(scores, pos, ps, c.index_topk_pages)
    latent = pages.gather(layer, rows, top, h @ p["w_dkv"]).to(model.dtype)
    key_pos, valid = _page_positions(top, pos, ps)
    absorbed, q_rope = _queries(model, p, h, pos)
    queries = (absorbed[:, None], q_rope[:, None])
    return _attend_latent(model, p, queries, latent, key_pos, valid[:, None])[:, 0]


def sparse_latent_outputs(
    model: TinyTransformer,
    p: dict[str, torch.Tensor],
    h: torch.Tensor,
    step: tuple[Sequence[int], Sequence[AttentionInputs], list[DecodeRows]],
    pools: Mapping[str, DevicePool],
    layer: int,
    hot: DecodePages | None,
) -> list[torch.Tensor]:
    """A DSA layer's token mixing for every chunk of a step (``step``: the chunks' bounds in
    ``h``, their inputs, and their one-token chunks from :func:`decode_rows`): one-token chunks
    batched per page source (the hot buffer for rows with a ``hot_row``), longer ones per
    request."""
    bounds, inputs, groups = step
    outs: list[torch.Tensor | None] = [None] * len(inputs)
    for rows in groups:
        if rows.hot_rows is not None and hot is None:
            raise ValueError("chunks with a hot_row need the HiSparse hot buffer")
        source = hot if rows.hot_rows is not None else AnchorPages(pools, model.config.page_size)
        assert source is not None
        out = sparse_decode(model, p, h[rows.token_rows], layer, rows, source)
        for row, i in enumerate(rows.chunks):
            outs[i] = out[row : row + 1]
    for i, inp in enumerate(inputs):
        if outs[i] is None:
            outs[i] = sparse_prefill(model, p, h[bounds[i] : bounds[i + 1]], pools, layer, inp)
    return [out for out in outs if out is not None]
