"""``os.open`` flags that not every platform defines, as 0 where it lacks them, so that the
stores' flag expressions read the same everywhere (no ``O_NOFOLLOW`` on Windows, say)."""

from __future__ import annotations

import os

__all__ = ["CLOEXEC", "NOFOLLOW"]

CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
