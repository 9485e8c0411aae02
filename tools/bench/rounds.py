"""Figures from alternating rounds: a median with its range, and paired ratios.

Every benchmark here times its own side and a baseline in the same run, side after side, round
after round, because this machine is shared and noisy. A round's two sides ran one right after
the other, so the ratio of the two within one round is the stable figure; the median over the
rounds is reported, with the range of the rounds' ratios beside it (``NAME_min``,
``NAME_max``), so that one run says how far to trust it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["gb_s", "paired_ratio", "rotated", "spread"]


def gb_s(nbytes: int, seconds: Sequence[float]) -> float:
    """GB/s of moving ``nbytes`` in the median of ``seconds`` (one time per round)."""
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def spread(name: str, values: Sequence[float], digits: int) -> dict[str, float]:
    """``name``: the median of ``values``; ``name_min`` and ``name_max``: their range."""
    return {
        name: round(statistics.median(values), digits),
        f"{name}_min": round(min(values), digits),
        f"{name}_max": round(max(values), digits),
    }


def paired_ratio(
    name: str, ours_s: Sequence[float], baseline_s: Sequence[float], digits: int = 3
) -> dict[str, float]:
    """Throughput of ours over the baseline's, from each round's two times (seconds for the
    same work): the median of the rounds' ratios, and their range."""
    if len(ours_s) != len(baseline_s) or not ours_s:
        raise ValueError("paired rounds need as many baseline times as ours, at least one")
    ratios = [base / ours for ours, base in zip(ours_s, baseline_s, strict=True)]
    return spread(name, ratios, digits)


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` starting at ``round_index`` (mod their number): over as many rounds as there
    are names, each takes each place once, so no side always runs first (or right after a
    particular other)."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]
