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
        backends=(name,), objects=40, object_bytes=65536, repeats=2, directory=str(tmp_path)
    )
    (row,) = await run_backend_bench(cfg)
    assert (row["backend"], row["objects"], row["object_bytes"]) == (name, 40, 65536)
    assert all(row[k] > 0 for k in _FIGURES)
    for op in ("put", "get"):
        # Each ratio is the backend's throughput over that baseline's, as reported.
        assert row[f"{op}_ratio"] == pytest.approx(
            row[f"{op}_gbps"] / row[f"raw_{op}_gbps"], rel=0.03
        )
        assert row[f"{op}_ratio_blocking"] == pytest.approx(
            row[f"{op}_gbps"] / row[f"raw_{op}_blocking_gbps"], rel=0.03
        )
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
