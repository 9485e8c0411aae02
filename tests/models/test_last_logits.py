"""Logits from the last hidden states: the same numbers as ``F.linear``, one row or many."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hicache.models.step import last_logits


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_logits_are_the_heads_projection(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    head = torch.randn(1000, 64, generator=gen).to(dtype)
    lasts = torch.randn(rows, 64, generator=gen).to(dtype)
    got = last_logits(lasts, head)
    want = F.linear(lasts.to(torch.float64), head.to(torch.float64))
    assert len(got) == rows
    for row, logits in enumerate(got):
        assert logits.dtype == torch.float32 and logits.shape == (1000,)
        assert logits.device.type == "cpu"
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(logits.double(), want[row], rtol=tolerance, atol=tolerance * 8)


def test_one_row_is_computed_alone() -> None:
    """One row goes through as two copies of itself; only its own logits come back."""
    head = torch.randn(50, 16)
    lasts = torch.randn(1, 16)
    (only,) = last_logits(lasts, head)
    torch.testing.assert_close(only, (head @ lasts[0]).float())
