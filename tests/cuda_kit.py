"""The mark of the tests that need a CUDA device: they skip, saying so, on a machine without one."""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
