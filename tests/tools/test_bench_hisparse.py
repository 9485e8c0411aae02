"""``hicache bench hisparse`` at its smallest: the runs of a concurrency share one prefill (the
first computes the prompts and writes them to the runs' L3; the others read them back), and
every run generates the same tokens. No figure is asserted: those are the benchmark's."""

from __future__ import annotations

import json

import pytest
from cli_kit import run


def test_later_runs_read_the_first_runs_prompts_back(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--context", "512", "--output-tokens", "4", "--low", "1", "--high", "2"]
    code, out, err = run(capsys, "bench", "hisparse", *argv, "--page-size", "64", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    summary = rows.pop()
    assert summary["outputs_identical"] is True
    for concurrency in (1, 2):
        runs = [r for r in rows if r["concurrency"] == concurrency]
        assert [r["copies"] for r in runs] == [None, "overlap", "sync"]
        first, *later = runs
        assert first["computed_tokens"] == 512 * concurrency  # a cold L3 for each concurrency
        for r in later:  # every whole page read back: only the last token's page computed
            assert 0 < r["computed_tokens"] <= 64 * concurrency, r
        assert all(r["failed"] == 0 and r["decode_steps"] > 0 for r in runs)
