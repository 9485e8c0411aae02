"""The engine benchmarks' page-cache floors (tools/bench/engines/floor.py): what they time and
report."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.machine import machine_threads
from hicache.tools.bench.engines import floor as floor_mod
from hicache.tools.bench.engines.floor import (
    PageCacheFloor,
    floor_figures,
    floor_sides,
    settle_memory,
)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_floor_round_trips_every_page_and_keeps_its_files_until_closed(
    tmp_path: Path, threads: int
) -> None:
    floor = PageCacheFloor(str(tmp_path), pages=5, page_bytes=64 << 10, threads=threads)
    first = floor.round_trip()
    second = floor.round_trip()
    assert all(s > 0 for s in (*first, *second))
    assert len(list(tmp_path.glob(f"floor-{threads}.*"))) == 2  # every round's file is kept
    assert not list(tmp_path.glob("settle*"))
    floor.close()
    assert not list(tmp_path.iterdir())


def test_a_floor_that_reads_back_other_bytes_fails(tmp_path: Path, monkeypatch) -> None:
    floor = PageCacheFloor(str(tmp_path), pages=2, page_bytes=4096, threads=2)
    real = floor_mod.os.preadv

    def flipped(fd: int, views: list[memoryview], offset: int) -> int:
        got = real(fd, views, offset)
        views[0][0] ^= 0xFF  # one byte wrong
        return got

    monkeypatch.setattr(floor_mod.os, "preadv", flipped)
    with pytest.raises(RuntimeError, match="differ"):
        floor.round_trip()
    floor.close()


def test_floor_sides_are_one_stream_and_one_per_cpu(tmp_path: Path) -> None:
    sides = floor_sides(str(tmp_path), 1, 4096)
    try:
        want = {"floor_1", f"floor_{machine_threads()}"}
        assert set(sides) == want
        assert {f.threads for f in sides.values()} == {int(n.split("_")[1]) for n in want}
    finally:
        for side in sides.values():
            side.close()


def test_settle_memory_writes_and_removes_its_file(tmp_path: Path) -> None:
    settle_memory(str(tmp_path), (8 << 20) + 12345)  # more than one chunk, and a tail
    assert not list(tmp_path.iterdir())


def test_floor_figures_compare_each_floor_with_both_sides() -> None:
    timings = {
        "hicache": {"put": [2.0, 4.0], "get": [1.0, 1.0]},
        "theirs": {"put": [1.0, 1.0], "get": [2.0, 2.0]},
        "floor_1": {"put": [1.0, 2.0], "get": [0.5, 0.5]},
    }
    row = floor_figures(timings, 10**9, "hicache", "theirs")
    assert row["floor_1_put_gb_s"] == pytest.approx(1 / 1.5, abs=1e-3)
    assert row["floor_1_get_ratio"] == 4.0  # the floor over theirs: 2 s / 0.5 s
    assert row["put_over_floor_1"] == 0.5  # ours over the floor, each round: 1/2 and 2/4
    assert row["get_over_floor_1"] == 0.5
    assert not any(k.startswith("floor_hicache") for k in row)
