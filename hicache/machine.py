"""What this process may use of the machine it runs on: its CPUs.

A leaf module (no hicache imports), so a backend's default thread count and a benchmark's
floors read the same figure.
"""

from __future__ import annotations

import os

__all__ = ["machine_threads"]


def machine_threads() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
