"""``hicache bench sglang`` runs SGLang's own page functions on both sides and reports ratios
(tiny pages here: the figures themselves are recorded in docs/BENCHMARKS.md, not tested)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_kit import run_without

pytest.importorskip(
    "sglang", reason="SGLang is installed only in the SGLang venv (make test-sglang)"
)


@pytest.mark.slow  # a whole subprocess end to end: out of `-m "not slow"`
def test_bench_sglang_reports_every_backend(tmp_path) -> None:
    argv = [sys.executable, "-m", "hicache.tools.cli", "bench", "sglang", "--json",
            "--layers", "2", "--heads", "2", "--head-dim", "16", "--page-size", "4",
            "--pages", "8", "--rounds", "2", "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["backend"] for row in rows] == ["disk", "file", "mooncake"]
    for row in rows:
        assert row["page_bytes"] == 2 * 2 * 2 * 16 * 4 * 2 and row["checksummed"] is True
        for op in ("put", "get"):
            assert row[f"{op}_ratio"] > 0 and row[f"hicache_{op}_gb_s"] > 0
            # The page-cache floors run beside the file stores only.
            floor = row["backend"] != "mooncake"
            assert (f"floor_1_{op}_ratio" in row) is floor
            assert not floor or row[f"floor_1_{op}_gb_s"] > 0 < row[f"floor_1_{op}_ratio_min"]
            assert not floor or row[f"{op}_over_floor_1"] > 0
    # Each comparison has stores of its own, and the floor's files are gone.
    disk, file = tmp_path / "comparison-0", tmp_path / "comparison-1"
    assert (disk / "hicache-disk" / "hicache-disk.json").is_file()  # a disk store
    assert (file / "hicache-file").is_dir()
    assert not list(tmp_path.rglob("floor*")) and not list(tmp_path.rglob("settle*"))


def test_bench_sglang_without_sglang_says_where_to_run_it(tmp_path) -> None:
    done = run_without("sglang", "bench", "sglang", "--backend", "file")
    assert done.returncode != 0
    assert ".venv-sglang/bin/hicache bench sglang" in done.stderr
