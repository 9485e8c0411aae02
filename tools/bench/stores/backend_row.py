"""The figures of a ``hicache bench backends`` row, from the rounds' wall and CPU seconds of
each step: medians with their ranges, and the paired ratios of the backend over its baseline."""

from __future__ import annotations

from typing import Any

from hicache.tools.bench.rounds import paired_ratio, spread

__all__ = ["backend_row", "cpu_figures"]


def backend_row(
    name: str, objects: int, object_bytes: int, times: dict[str, list[float]]
) -> dict[str, Any]:
    """The row of one backend: its size, and ``LABEL_gbps`` (``LABEL_kops`` for ``exists``)
    and the paired ratios of each step over the rounds' wall ``times``."""
    nbytes = objects * object_bytes
    out: dict[str, Any] = {
        "backend": name,
        "object_bytes": object_bytes,
        "objects": objects,
        "rounds": len(times["put"]),
    }
    for label, seconds in times.items():
        if label.endswith("exists"):  # no bytes move: keys a second
            out.update(spread(f"{label}_kops", [objects / t / 1e3 for t in seconds], 1))
        else:
            out.update(spread(f"{label}_gbps", [nbytes / t / 1e9 for t in seconds], 3))
    for op in ("put", "get", "exists"):
        for way in ("", "_blocking"):
            if op in times and f"raw_{op}{way}" in times:
                out.update(paired_ratio(f"{op}_ratio{way}", times[op], times[f"raw_{op}{way}"]))
    return out


def cpu_figures(objects: int, cpu: dict[str, list[float]]) -> dict[str, Any]:
    """``LABEL_cpu_us``: process CPU microseconds (every thread's) per object of each step, the
    median of the rounds with its range; ``put_cpu_ratio``, ``get_cpu_ratio``: the backend's
    CPU over the async raw baseline's, the median of the rounds' own ratios (above 1: the
    backend spends more)."""
    out: dict[str, Any] = {}
    for label, seconds in cpu.items():
        out.update(spread(f"{label}_cpu_us", [s / objects * 1e6 for s in seconds], 2))
    for op in ("put", "get", "exists"):
        if f"raw_{op}" not in cpu:
            continue
        # paired_ratio gives baseline over ours: pass them swapped for backend over raw. The
        # floor keeps a step too short for the CPU clock from dividing by zero.
        raw = [max(s, 1e-9) for s in cpu[f"raw_{op}"]]
        out.update(paired_ratio(f"{op}_cpu_ratio", raw, cpu[op]))
    return out
