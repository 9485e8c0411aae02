"""``hicache bench controller``: the method (sync, rotation, medians) and a small real run."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import pytest

from hicache.tools.bench.cache import controller as bench_controller
from hicache.tools.bench.cache.controller import run_bench_controller

_SPREAD = (
    "overhead_us_per_page",
    "with_backend_us_per_page",
    "round_trip_us_per_page",
    "l3_roundtrip_gbps",
    "raw_roundtrip_gbps",
    "l3_roundtrip_ratio",
)


def _args(tmp_path: pathlib.Path, repeats: int = 3) -> argparse.Namespace:
    return argparse.Namespace(
        overhead_pages=4, sequences=2, pages=8, repeats=repeats, dir=str(tmp_path), json=True
    )


def test_small_run_reports_medians_with_their_range(tmp_path: pathlib.Path) -> None:
    (row,) = run_bench_controller(_args(tmp_path))
    assert row["rounds"] == 3 and row["pages"] == 8 and row["page_bytes"] == 2 << 20
    for name in _SPREAD:
        assert 0 < row[f"{name}_min"] <= row[name] <= row[f"{name}_max"], name
    assert row["overhead_us_per_page"] < row["with_backend_us_per_page"]
    assert row["overhead_pages_moved"] == 4 * 4 * 2  # pages x sequences, four moves each
    assert list(tmp_path.iterdir()) == []  # the scratch stores are removed


async def test_every_step_starts_after_a_sync_and_the_order_rotates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(bench_controller.os, "sync", lambda: calls.append("sync"))

    def step(name: str) -> Any:
        async def run(r: int) -> float:
            calls.append(f"{name}{r}")
            return float(r)

        return run

    times = await bench_controller._timed_rounds({"a": step("a"), "b": step("b")}, 3)
    order = [c for c in calls if c != "sync"]
    assert order == ["a0", "b0", "b1", "a1", "a2", "b2"]  # who goes first alternates
    assert calls == [x for c in order for x in ("sync", c)]  # a sync before every step
    calls.clear()
    steps = {"a": step("a"), "b": step("b"), "o": step("o")}
    await bench_controller._timed_rounds(steps, 2, first="o")
    assert [c for c in calls if c != "sync"] == ["o0", "a0", "b0", "o1", "b1", "a1"]
    assert times == {"a": [0.0, 1.0, 2.0], "b": [0.0, 1.0, 2.0]}


def test_ratio_is_that_of_the_median_times(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Scripted seconds per round (the last entry is the warm-up, untimed). A best-of-N would
    # report 1.0, and so would the median of the rounds' own ratios (1.0, 0.5, 1.0).
    scripted = {"controller": [1.0, 2.0, 3.0, 9.0], "raw": [1.0, 1.0, 3.0, 9.0]}

    def fake(side: str) -> Any:
        async def run(*args: Any) -> float:
            seconds, cpu = scripted[side][args[-2]], args[-1]  # (..., round, CPU log)
            cpu.seconds[side].append(seconds / 2)  # half of it on the CPU
            return seconds

        return run

    monkeypatch.setattr(bench_controller, "roundtrip_controller", fake("controller"))
    monkeypatch.setattr(bench_controller, "roundtrip_raw", fake("raw"))
    monkeypatch.setattr(bench_controller, "_overhead_round", _scripted_overhead_round)
    (row,) = run_bench_controller(_args(tmp_path))
    assert row["l3_roundtrip_ratio"] == 0.5  # median raw 1 s over median controller 2 s
    assert (row["l3_roundtrip_ratio_min"], row["l3_roundtrip_ratio_max"]) == (0.5, 1.0)
    moved = 2 * 8 * (2 << 20) / 1e9
    assert row["l3_roundtrip_gbps"] == round(moved / 2.0, 3)
    assert row["l3_roundtrip_gbps_min"] == round(moved / 3.0, 3)
    assert row["raw_roundtrip_gbps"] == round(moved / 1.0, 3)
    assert row["overhead_us_per_page"] == round(0.0024 / 32 * 1e6, 2)
    # CPU per page of 8 pages (the warm-up's left out): the medians, and of the rounds'
    # differences (0, 0.5, 0 s).
    assert row["l3_roundtrip_cpu_us_per_page"] == round(1.0 / 8 * 1e6, 1)
    assert row["raw_roundtrip_cpu_us_per_page"] == round(0.5 / 8 * 1e6, 1)
    assert row["l3_roundtrip_extra_cpu_us_per_page"] == 0.0
    assert row["l3_roundtrip_extra_cpu_us_per_page_max"] == round(0.5 / 8 * 1e6, 1)


async def _scripted_overhead_round(pages: int, seqs: int) -> tuple[float, float, int]:
    return 0.0032, 0.0008, 4 * pages * seqs  # CPU seconds, of which in the backend; moves


def test_nonpositive_sizes_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        run_bench_controller(_args(tmp_path, repeats=0))
