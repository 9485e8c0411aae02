"""``hicache bench lmcache`` runs LMCache's own StorageManager on both sides and reports ratios
(tiny chunks here: the figures themselves are recorded in docs/BENCHMARKS.md, not tested)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_kit import run_without

pytest.importorskip(
    "lmcache", reason="LMCache is installed only in the LMCache venv (.venv-lmcache)"
)


@pytest.mark.slow  # a whole subprocess end to end: out of `-m "not slow"`
def test_bench_lmcache_reports_both_sides(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "hicache.tools.cli", "bench", "lmcache", "--json",
            "--layers", "2", "--heads", "2", "--head-dim", "16", "--chunk-tokens", "16",
            "--chunks", "4", "--rounds", "2", "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["chunk_bytes"] == 2 * 2 * 16 * 2 * 16 * 2 and row["chunks"] == 4
    assert row["rounds"] == 2 and row["checked"] is True
    for op in ("put", "get"):
        for field in (f"hicache_{op}_gb_s", f"lmcache_{op}_gb_s", f"{op}_ratio",
                      f"floor_1_{op}_gb_s", f"floor_1_{op}_ratio",
                      f"{op}_over_floor_1"):  # fmt: skip
            assert row[field] > 0, field
        # A floor per thread count: one stream, and one per CPU when there are more.
        floors = {k.split("_")[1] for k in row if k.startswith("floor_") and k.endswith("_gb_s")}
        assert "1" in floors and len(floors) == len({1, len(os.sched_getaffinity(0))})
    assert not list(tmp_path.glob("floor*"))  # the page-cache floors' files are removed
    assert not list(tmp_path.glob("settle*"))
    # Both stores were written, each in its own format: a disk:// store and one file a chunk.
    assert (tmp_path / "hicache" / "hicache-disk.json").is_file()
    assert any((tmp_path / "hicache" / "segments").iterdir())
    assert len(list((tmp_path / "lmcache").glob("*.pt"))) == 2 * 4  # 2 rounds of 4 chunks


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")
@pytest.mark.parametrize("remote", ["redis", "redis-cluster"])
def test_bench_lmcache_over_redis_compares_the_two_redis_connectors(
    tmp_path: Path, remote: str
) -> None:
    argv = [sys.executable, "-m", "hicache.tools.cli", "bench", "lmcache", "--json",
            "--remote", remote, "--layers", "2", "--heads", "2", "--head-dim", "16",
            "--chunk-tokens", "16", "--chunks", "4", "--rounds", "2",
            "--dir", str(tmp_path)]  # fmt: skip
    # LMCache's own Redis connectors cannot close (their close waits on their own loop): the
    # bench stops their queues first, so the run ends rather than hanging here.
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    tier = "RemoteBackend-redis" if remote == "redis" else "RemoteBackend"  # redis-cluster://
    assert row["lmcache_tier"] == tier and row["checked"] is True
    for op in ("put", "get"):
        # Throughputs are rounded (a few KiB a round can show 0.0 under load); the ratios
        # are of the rounds' times themselves.
        assert row[f"hicache_{op}_gb_s"] >= 0 and row[f"lmcache_{op}_gb_s"] >= 0
        assert 0 < row[f"{op}_ratio_min"] <= row[f"{op}_ratio"] <= row[f"{op}_ratio_max"]
    assert not any(k.startswith("floor_") for k in row)  # no page-cache floor over a network
    assert not list(tmp_path.glob("hicache")) and not list(tmp_path.glob("lmcache"))


def test_bench_lmcache_refuses_a_directory_with_stores_in_it(tmp_path: Path) -> None:
    (tmp_path / "lmcache").mkdir()
    argv = [sys.executable, "-m", "hicache.tools.cli", "bench", "lmcache", "--chunks", "1",
            "--rounds", "1", "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "exists" in done.stderr


def test_bench_lmcache_without_lmcache_says_where_to_run_it() -> None:
    done = run_without("lmcache", "bench", "lmcache", "--chunks", "1")
    assert done.returncode != 0
    assert ".venv-lmcache/bin/hicache bench lmcache" in done.stderr
