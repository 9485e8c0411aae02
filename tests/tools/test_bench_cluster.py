"""``hicache bench cluster`` end to end on a tiny model: the baseline in process, one worker over
HTTP, and two workers behind a router, each a row of the documented fields, then the summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serve_kit import SMALL

ROW_KEYS = {"workers", "router", "requests", "hit_rate", "l3_hit_rate", "l3_hit_tokens",
            "l3_cross_worker_hit_tokens", "ttft_mean_ms", "ttft_p50_ms", "throughput_tok_s",
            "wall_s"}  # fmt: skip


@pytest.mark.slow  # a whole subprocess end to end: out of `-m "not slow"`
def test_bench_cluster_rows_and_summary() -> None:
    argv = [sys.executable, "-m", "hicache.tools.cli", "bench", "cluster", "--json",
            "--workers", "2", "--router", "round_robin", "--requests", "8", "--tenants", "2",
            "--concurrency", "2", "--prefix-tokens", "64", "--suffix-tokens", "8",
            "--serve-args", " ".join([*SMALL, "--vocab", "4096"])]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert [(r["workers"], r["router"]) for r in rows] == [
        (1, "in_process"),
        (1, "http"),
        (2, "round_robin"),
    ]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["requests"] == 8 and 0 < row["hit_rate"] < 1, row
        assert row["throughput_tok_s"] > 0 and row["ttft_mean_ms"] > 0
        assert 0 <= row["l3_cross_worker_hit_tokens"] <= row["l3_hit_tokens"]
    assert rows[0]["l3_hit_tokens"] == 0  # one engine: its prefixes stay on device or host
    assert summary["summary"] is True and isinstance(summary["http_ttft_overhead"], float)
    assert "round_robin_l3_cross_worker_hit_tokens_2w" in summary
