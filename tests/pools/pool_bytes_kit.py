"""Random and byte views of tensors, shared by the device and host pool tests."""

from __future__ import annotations

import torch


def random_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes (NaN patterns included) viewed as ``dtype``."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.empty(nbytes, dtype=torch.uint8)
    raw.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()
