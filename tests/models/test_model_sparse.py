"""DSA layers computed sparsely (:mod:`hicache.models.sparse`), at the model level.

``top_pages`` picks what each query reads; a decode token's logits then depend on the latent of
its chosen pages only (bit for bit), and the batched decode path gives what each token alone
gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from model_kit import PAGE, VOCAB, relative_error, tiny_model

from hicache.models import sparse as model_sparse
from hicache.models.config import ModelPreset
from hicache.models.sparse import top_pages
from hicache.models.tiny import TinyTransformer
from hicache.models.types import ChunkInput
from hicache.pools.device import DevicePool, device_pools

TopPages = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


# ----- top_pages --------------------------------------------------------------------------------
def _pages_up_to(position: int) -> int:
    return position // PAGE + 1


@pytest.mark.parametrize("seed", range(6))
def test_top_pages_own_page_first_and_never_past_the_query(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    total = 5 * PAGE + 3  # a last, partial page
    positions = torch.randint(0, total, (16,), generator=gen)
    scores = torch.randn(16, total, generator=gen, dtype=torch.float64)
    for k in (1, 2, 4, 8):
        top = top_pages(scores, positions, PAGE, k)
        n_pages = -(-total // PAGE)
        assert top.shape == (16, min(k, n_pages)) and top.dtype == torch.int64
        for row, pos in zip(top.tolist(), positions.tolist(), strict=True):
            own, allowed = pos // PAGE, _pages_up_to(pos)
            assert row[0] == own, (row, pos)
            chosen = [p for p in row if p >= 0]
            assert all(p <= own for p in chosen), (row, pos)
            assert len(set(chosen)) == len(chosen)
            # As many pages as the query may read, up to k; padding only at the end.
            assert len(chosen) == min(k, allowed, n_pages)
            assert row[len(chosen) :] == [-1] * (len(row) - len(chosen))


@pytest.mark.parametrize("seed", range(6))
def test_top_pages_picks_the_best_scoring_pages(seed: int) -> None:
    """The pages after the own one are those whose best token scores highest, best first."""
    gen = torch.Generator().manual_seed(100 + seed)
    total, k = 8 * PAGE, 3
    position = int(torch.randint(2 * PAGE, total, (1,), generator=gen))
    scores = torch.randn(1, total, generator=gen, dtype=torch.float64)
    top = top_pages(scores, torch.tensor([position]), PAGE, k)[0].tolist()
    own = position // PAGE
    best: dict[int, float] = {}
    for t in range(position + 1):  # tokens after the query never count, not even in its page
        best[t // PAGE] = max(best.get(t // PAGE, -math.inf), float(scores[0, t]))
    others = sorted((p for p in best if p != own), key=lambda p: -best[p])
    assert top == [own, *others[: k - 1]]


def test_top_pages_ignores_scores_after_the_query_position() -> None:
    """A huge score on a token after the query, even in the query's own page, changes nothing."""
    scores = torch.zeros(1, 4 * PAGE, dtype=torch.float64)
    scores[0, 1] = 5.0  # page 0
    scores[0, PAGE + 2] = 3.0  # page 1
    position = torch.tensor([2 * PAGE + 1])  # page 2, at its second token
    before = top_pages(scores, position, PAGE, 3)
    scores[0, 3 * PAGE :] = 1e9  # page 3: entirely in the future
    scores[0, 2 * PAGE + 2] = 1e9  # later in the own page
    after = top_pages(scores, position, PAGE, 3)
    assert before.tolist() == after.tolist() == [[2, 0, 1]]
    assert top_pages(scores, position, PAGE, 2).tolist() == [[2, 0]]


def test_top_pages_pads_with_minus_one() -> None:
    """Fewer readable pages than k: -1 after them, and no more columns than the context has."""
    scores = torch.randn(3, 3 * PAGE, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, PAGE + 1, 3 * PAGE - 1])
    top = top_pages(scores, positions, PAGE, 5)
    assert top.shape == (3, 3)  # min(k, pages of the context)
    assert top[0].tolist() == [0, -1, -1]
    assert top[1, 0] == 1 and top[1, 1] == 0 and top[1, 2] == -1
    assert top[2, 0] == 2 and sorted(top[2, 1:].tolist()) == [0, 1]


def test_top_pages_ties_keep_page_order() -> None:
    """Equal scores: lower pages first (a stable sort), the own page still first."""
    total = 6 * PAGE
    scores = torch.zeros(2, total, dtype=torch.float64)
    positions = torch.tensor([total - 1, 3 * PAGE])
    top = top_pages(scores, positions, PAGE, 4)
    assert top.tolist() == [[5, 0, 1, 2], [3, 0, 1, 2]]
    # A tie between pages 1 and 4 above the rest: 1 before 4.
    scores[0, PAGE + 2] = scores[0, 4 * PAGE] = 2.0
    assert top_pages(scores[:1], positions[:1], PAGE, 4).tolist() == [[5, 1, 4, 0]]


# ----- the model: decode reads its chosen pages and nothing else --------------------------------
CONTEXT = 10 * PAGE + 2  # 11 pages, many more than the top-k (2)


def _model() -> TinyTransformer:
    model = tiny_model(ModelPreset.DSA)
    assert model.config.index_topk_pages < CONTEXT // PAGE
    return model


def _pools(model: TinyTransformer, tokens: int = 256) -> dict[str, DevicePool]:
    return device_pools(model.config.pools(), {"latent": tokens})


def _prefilled(
    model: TinyTransformer, pools: dict[str, DevicePool], seed: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt of ``length`` tokens computed into fresh slots (room for one more token):
    its slots, and its next token."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (length + 1,), generator=gen)
    slots = pools["latent"].alloc(-(-(length + 1) // PAGE) * PAGE)
    assert slots is not None
    model.forward(ChunkInput(tokens[:length], 0, slots[:length]), pools)
    return slots[: length + 1], tokens[length:]


def _decode(
    model: TinyTransformer, pools: dict[str, DevicePool], slots: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    return model.forward(ChunkInput(token, len(slots) - 1, slots), pools)


def _chosen_pages(
    model: TinyTransformer,
    pools: dict[str, DevicePool],
    slots: torch.Tensor,
    token: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[torch.Tensor, list[set[int]]]:
    """The decode token's logits, and the pages it read in each layer (by recording what
    ``top_pages`` returned inside the model)."""
    seen: list[set[int]] = []
    real: TopPages = model_sparse.top_pages

    def recording(scores: torch.Tensor, positions: torch.Tensor, ps: int, k: int) -> torch.Tensor:
        top = real(scores, positions, ps, k)
        assert top.shape[0] == 1, "one decode token"
        seen.append({int(p) for p in top[0] if p >= 0})
        return top

    with monkeypatch.context() as patch:
        patch.setattr(model_sparse, "top_pages", recording)
        logits = _decode(model, pools, slots, token)
    assert len(seen) == model.config.layers
    return logits, seen


def _corrupted(pools: dict[str, DevicePool], slots: torch.Tensor, page: int) -> None:
    """NaN in the latent of every token of ``page``, in every layer."""
    latent = pools["latent"].buffer
    latent[:, :, slots[page * PAGE : (page + 1) * PAGE]] = math.nan


def _snapshot(pools: dict[str, DevicePool]) -> dict[str, torch.Tensor]:
    return {name: pool.buffer.clone() for name, pool in pools.items()}


def _restore(pools: dict[str, DevicePool], saved: dict[str, torch.Tensor]) -> None:
    for name, pool in pools.items():
        pool.buffer.copy_(saved[name])


def test_decode_reads_only_its_top_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    pools = _pools(model)
    slots, token = _prefilled(model, pools, seed=5, length=CONTEXT)
    saved = _snapshot(pools)
    want, chosen = _chosen_pages(model, pools, slots, token, monkeypatch)
    own = CONTEXT // PAGE
    assert all(own in layer for layer in chosen)
    read = set().union(*chosen)
    unread = [p for p in range(own + 1) if p not in read]
    others = sorted(read - {own})
    assert unread and others, (chosen, own)

    # Every page no layer chose, poisoned in every layer: the same logits, bit for bit.
    _restore(pools, saved)
    for page in unread:
        _corrupted(pools, slots, page)
    got = _decode(model, pools, slots, token)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)

    # A chosen page (not the token's own), poisoned: the logits change.
    for page in others:
        _restore(pools, saved)
        _corrupted(pools, slots, page)
        changed = _decode(model, pools, slots, token)
        assert not torch.equal(changed, want), page
        assert not torch.isfinite(changed).all(), page


# ----- the batched decode path ------------------------------------------------------------------
def test_batched_decode_equals_each_token_alone() -> None:
    """One-token chunks of several requests in one forward_batch: each one's logits are those
    of its token computed alone (contexts of different lengths, one shorter than the top-k)."""
    model = _model()
    pools = _pools(model, 512)
    lengths = [CONTEXT, 3, 2 * PAGE, 5 * PAGE + 1, 17]
    requests = [_prefilled(model, pools, seed=20 + i, length=n) for i, n in enumerate(lengths)]
    chunks = [ChunkInput(token, len(slots) - 1, slots) for slots, token in requests]
    saved = _snapshot(pools)
    batched = model.forward_batch(chunks, pools)
    after_batch = _snapshot(pools)
    assert len(batched) == len(lengths)
    for i, (slots, token) in enumerate(requests):
        _restore(pools, saved)
        alone = _decode(model, pools, slots, token)
        assert relative_error(batched[i], alone) <= 1e-12, lengths[i]
        # The batch cached each token as computing it alone does.
        for name, pool in pools.items():
            new = slots[-1:]
            assert torch.equal(after_batch[name][:, :, new], pool.buffer[:, :, new]), name
    # And the requests really differ (the comparison is not between copies).
    assert min(relative_error(batched[0], other) for other in batched[1:]) > 1e-3
