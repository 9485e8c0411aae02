"""``hicache bench backends``: both baselines run, move the same bytes, and report ratios."""

from __future__ import annotations

import pathlib

import pytest

from hicache.tools.bench.backends import BackendBenchConfig, run_backend_bench

_FIGURES = (
    "put_gbps",
    "get_gbps",
    "raw_put_gbps",
    "raw_get_gbps",
    "raw_put_blocking_gbps",
    "raw_get_blocking_gbps",
)


@pytest.mark.parametrize("name", ["memory", "file", "3fs"])
async def test_small_run_reports_every_figure(name: str, tmp_path: pathlib.Path) -> None:
    cfg = BackendBenchConfig(
        backends=(name,), objects=40, object_bytes=65536, repeats=3, directory=str(tmp_path)
    )
    (row,) = await run_backend_bench(cfg)
    assert (row["backend"], row["objects"], row["object_bytes"]) == (name, 40, 65536)
    assert row["rounds"] == 3 and all(row[k] > 0 for k in _FIGURES)
    for figure in _FIGURES:  # the median of the rounds, inside their range
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
    assert list(tmp_path.iterdir()) == []  # the scratch store is removed


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
