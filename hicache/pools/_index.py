"""Checking slot and page indices before any pool changes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.errors import InvalidArgumentError

__all__ = ["IndexLike", "check_indices"]

IndexLike = torch.Tensor | Sequence[int]


def check_indices(
    values: IndexLike, size: int, what: str, *, distinct: bool = True
) -> torch.Tensor:
    """``values`` as a 1-D int64 CPU tensor of indices in ``[0, size)``, distinct unless told.

    Raises :class:`InvalidArgumentError` for a non-integer, out-of-range or repeated index.
    """
    if isinstance(values, torch.Tensor):
        index = values
    else:
        items = list(values)
        if not items:
            return torch.empty(0, dtype=torch.int64)
        try:
            index = torch.as_tensor(items)  # no dtype: floats and bools stay visible, and fail
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(f"{what} indices must be integers: {exc}") from None
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise InvalidArgumentError(f"{what} indices must be integers, got {index.dtype}")
    index = index.detach().to("cpu", torch.int64).reshape(-1)
    if index.numel() == 0:
        return index
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise InvalidArgumentError(f"{what} index {bad} out of range [0, {size})")
    if distinct and torch.unique(index).numel() != index.numel():
        raise InvalidArgumentError(f"repeated {what} index: each may appear once")
    return index
