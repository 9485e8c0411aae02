"""``hicache bench vllm`` drives both tiers through vLLM's factory and reports ratios (tiny
sizes here: the figures themselves are recorded in docs/BENCHMARKS.md, not tested)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.fs.manager",
    reason="vLLM is installed only in the vLLM venv (make test-vllm)",
)

from cli_kit import run


def test_bench_vllm_reports_both_sides(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(
        capsys, "bench", "vllm", "--json", "--chunk-bytes", "8K", "--chunks", "8",
        "--job-chunks", "3", "--rounds", "2", "--lookup-keys", "40", "--dir", str(tmp_path),
    )  # fmt: skip
    assert code == 0, err[-2000:]
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert (row["chunk_bytes"], row["chunks"], row["job_chunks"]) == (8192, 8, 3)
    for side in ("hicache", "fs"):
        fields = ("store_gbps", "load_gbps", "store_cpu_us", "load_cpu_us")
        for field in (*fields, "submit_us_per_chunk", "known_lookup_us"):
            assert row[f"{side}_{field}"] > 0, (side, field)
        assert row[f"{side}_lookup_steps"] >= 1
        assert row[f"{side}_submit_calls"] == 2 * 2 * 3  # 2 rounds, store and load, 3 jobs
    for ratio in ("store_ratio", "load_ratio", "lookup_time_ratio"):
        assert row[ratio] > 0, ratio
    assert row["store_ratio_min"] <= row["store_ratio"] <= row["store_ratio_max"]
    assert row["lookup_keys"] == 40
    # Each side wrote its own store: a disk:// store, and vLLM's files.
    assert (tmp_path / "hicache" / "hicache-disk.json").is_file()
    assert any(p.is_file() for p in (tmp_path / "fs").rglob("*"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunk-bytes", "1000"], "--chunk-bytes"),
        (["--chunks", "0"], "--chunks"),
        (["--job-chunks", "x"], "--job-chunks"),
    ],
)
def test_bench_vllm_bad_sizes(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, "bench", "vllm", *argv)
    assert code == 2 and message in err
    assert "Traceback" not in err


def test_bench_vllm_refuses_a_used_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "fs").mkdir()
    code, _, err = run(capsys, "bench", "vllm", "--chunks", "1", "--dir", str(tmp_path))
    assert code == 2 and "exists" in err and len(err.strip().splitlines()) == 1
