"""What the layout tests share: the presets at test size, the preset-by-layout parametrization,
and random layout buffers (for the CPU and CUDA conversion, view and gather/scatter tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from hicache.layouts import KV_LAYOUTS, Layout, LayoutSpec, SpecPreset, buffer_shape

PRESETS = list(SpecPreset)
Test = TypeVar("Test", bound=Callable[..., None])


def small(preset: SpecPreset) -> LayoutSpec:
    """``preset`` at test size: pages of 4 tokens, 3 layers."""
    return preset.spec(page_size=4, layers=3)


def every_preset_and_layout(test: Test) -> Test:
    """Parametrizes ``test`` over every preset (``preset``) in every KV layout (``layout``)."""
    by_layout = pytest.mark.parametrize("layout", KV_LAYOUTS, ids=lambda x: x.label)(test)
    return pytest.mark.parametrize("preset", PRESETS)(by_layout)


def random_buffer(spec: LayoutSpec, layout: Layout, pages: int, seed: int) -> torch.Tensor:
    """Random bytes (NaN patterns included) as a CPU ``layout`` buffer."""
    raw = torch.empty(pages * spec.page_bytes, dtype=torch.uint8)
    raw.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return raw.view(spec.dtype.to_torch()).view(buffer_shape(spec, layout, pages))
