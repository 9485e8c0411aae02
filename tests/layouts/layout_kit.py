"""Random layout buffers, shared by the CPU and CUDA gather/scatter tests."""

from __future__ import annotations

import torch

from hicache.layouts import Layout, LayoutSpec, buffer_shape


def random_buffer(spec: LayoutSpec, layout: Layout, pages: int, seed: int) -> torch.Tensor:
    """Random bytes (NaN patterns included) as a CPU ``layout`` buffer."""
    raw = torch.empty(pages * spec.page_bytes, dtype=torch.uint8)
    raw.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return raw.view(spec.dtype.to_torch()).view(buffer_shape(spec, layout, pages))
