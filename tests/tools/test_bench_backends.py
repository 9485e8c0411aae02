"""``hicache bench backends``: both baselines run, move the same bytes, and report ratios,
CPU per object, and (``open_objects``) the open time of a store whose writer died."""

from __future__ import annotations

import os
import pathlib
import types

import numpy as np
import pytest

from hicache.tools.bench.stores import raw_disk
from hicache.tools.bench.stores.backends import BackendBenchConfig, run_backend_bench

_FIGURES = (
    "put_gbps",
    "get_gbps",
    "raw_put_gbps",
    "raw_get_gbps",
    "raw_put_blocking_gbps",
    "raw_get_blocking_gbps",
)
_CPU = tuple(f"{name.removesuffix('_gbps')}_cpu_us" for name in _FIGURES)


@pytest.mark.parametrize("name", ["memory", "file", "disk", "3fs"])
async def test_small_run_reports_every_figure(name: str, tmp_path: pathlib.Path) -> None:
    cfg = BackendBenchConfig(
        backends=(name,), objects=40, object_bytes=65536, repeats=3, directory=str(tmp_path)
    )
    (row,) = await run_backend_bench(cfg)
    assert (row["backend"], row["objects"], row["object_bytes"]) == (name, 40, 65536)
    assert row["rounds"] == 3 and all(row[k] > 0 for k in _FIGURES + _CPU)
    for figure in _FIGURES + _CPU:  # the median of the rounds, inside their range
        assert row[f"{figure}_min"] <= row[figure] <= row[f"{figure}_max"]
    for op in ("put", "get"):
        for base in (f"raw_{op}", f"raw_{op}_blocking"):
            ratio = f"{op}_ratio" + base.removeprefix(f"raw_{op}")
            # The median of the rounds' own ratios: inside their range, which lies inside
            # what the two sides' ranges allow.
            assert row[f"{ratio}_min"] <= row[ratio] <= row[f"{ratio}_max"]
            low = row[f"{op}_gbps_min"] / row[f"{base}_gbps_max"]
            high = row[f"{op}_gbps_max"] / row[f"{base}_gbps_min"]
            assert low * 0.99 <= row[f"{ratio}_min"] and row[f"{ratio}_max"] <= high * 1.01
    for ratio in ("put_cpu_ratio", "get_cpu_ratio"):
        assert 0 < row[f"{ratio}_min"] <= row[ratio] <= row[f"{ratio}_max"]
    assert list(tmp_path.iterdir()) == []  # the scratch store is removed


def test_raw_disk_baseline_round_trips_through_short_writes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preallocated file per round, the earlier ones kept; a pwritev that comes back short is
    finished from where it stopped, inside an object too."""
    source = np.random.default_rng(0).integers(0, 256, size=(40, 1000), dtype=np.uint8)
    work = types.SimpleNamespace(source=source, dest=np.zeros_like(source))
    put, get = raw_disk.raw_baseline(None, str(tmp_path), work)
    assert os.path.getsize(tmp_path / "raw-disk.0") == source.nbytes  # allocated up front
    real = os.pwritev

    def short(fd: int, views: list[memoryview], offset: int) -> int:
        """At most three objects, less the last 7 bytes of them (those are written again)."""
        done = real(fd, views[:3], offset)
        return done - 7 if done > 7 else done

    monkeypatch.setattr(os, "pwritev", short)
    for lo in range(0, 40, 32):
        put(work, lo, min(lo + 32, 40))
    monkeypatch.undo()
    for lo in range(0, 40, 32):
        get(work, lo, min(lo + 32, 40))
    assert np.array_equal(work.dest, source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw-disk.0", "raw-disk.1"]


async def test_open_of_a_store_whose_writer_died(tmp_path: pathlib.Path) -> None:
    cfg = BackendBenchConfig(
        backends=("disk", "file", "memory"), open_objects=2000, directory=str(tmp_path)
    )
    disk, file, memory = await run_backend_bench(cfg)  # each open checks count and contents
    for row in (disk, file):
        assert (row["open_objects"], row["objects"]) == (2000, 2000)
        assert 0 < row["open_s_min"] <= row["open_s"] <= row["open_s_max"]
        assert row["open_cpu_s"] > 0 and row["build_s"] > 0
    # No snapshot is due before 131072 records and the writer never closed: the open replays
    # every object from the log.
    assert (disk["snapshot_objects"], disk["log_records"], disk["snapshot_bytes"]) == (0, 2000, 0)
    assert disk["log_bytes"] > 2000 * 98 and disk["open_s_backend"] > 0
    assert "skipped" in memory and "open_s" not in memory
    assert list(tmp_path.iterdir()) == []


async def test_nixl_baseline_runs_against_its_own_files(tmp_path: pathlib.Path) -> None:
    from hicache.backends.nixl.agent import load_nixl_api
    from hicache.errors import BackendUnavailableError

    try:
        load_nixl_api()  # nixl_cu12 or nixl, whichever build is installed
    except BackendUnavailableError:
        pytest.skip("NIXL is not installed (pip install 'hicache[nixl]')")
    cfg = BackendBenchConfig(
        backends=("nixl",), objects=33, object_bytes=4096, repeats=1, directory=str(tmp_path)
    )
    (row,) = await run_backend_bench(cfg)  # raises if either side reads back other bytes
    assert row["put_ratio"] > 0 and row["get_ratio_blocking"] > 0


async def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        await run_backend_bench(BackendBenchConfig(objects=0))
