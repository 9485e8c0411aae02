"""``hicache bench layouts``: one row per (from, to) pair and per gather/scatter, all fields."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from hicache.errors import InvalidArgumentError
from hicache.layouts import KV_LAYOUTS, SpecPreset
from hicache.tools.bench.cache.layouts import (
    LayoutBenchConfig,
    add_bench_layouts_parser,
    main,
    run_bench_layouts,
    run_layout_bench,
    shared_run_bytes,
)

FIELDS = {"op", "from", "to", "device", "bytes", "gbps", "baseline_gbps", "ratio"}


def test_rows_cover_every_pair_and_both_transfers() -> None:
    spec = SpecPreset.ODD.spec(page_size=4)
    config = LayoutBenchConfig(
        preset=SpecPreset.ODD, page_size=4, cpu_bytes=3 * spec.page_bytes, repeats=1,
        devices=("cpu",),
    )  # fmt: skip
    rows = run_layout_bench(config)
    labels = [layout.label for layout in KV_LAYOUTS]
    converts = {(r["from"], r["to"]) for r in rows if r["op"] == "convert"}
    assert converts == {(a, b) for a in labels for b in labels}
    assert {r["to"] for r in rows if r["op"] == "gather"} == set(labels)
    assert {r["from"] for r in rows if r["op"] == "scatter"} == set(labels)
    assert len(rows) == 9 + 2 * 3
    for row in rows:
        assert set(row) >= FIELDS
        assert row["device"] == "cpu" and row["bytes"] == 3 * spec.page_bytes
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
        # One round: the median is that round, and its ratio that of the two GB/s figures.
        assert row["rounds"] == 1 and row["ratio_min"] == row["ratio"] == row["ratio_max"]
        assert row["ratio"] == pytest.approx(row["gbps"] / row["baseline_gbps"], rel=0.02, abs=0.02)
        # A transposing row also times a bare strided copy of its runs: its floor.
        transposes = row["from"] != row["to"]
        assert ("floor_gbps" in row) is transposes
        if transposes:
            assert row["floor_ratio"] == pytest.approx(
                row["gbps"] / row["floor_gbps"], rel=0.02, abs=0.02
            )


def test_shared_runs_of_the_layouts() -> None:
    spec = SpecPreset.MHA.spec(page_size=32)
    lf, pf, pfd = KV_LAYOUTS
    assert shared_run_bytes(spec, lf, lf) is None
    assert shared_run_bytes(spec, lf, pf) == spec.item_bytes  # page_first is token-major
    assert shared_run_bytes(spec, pf, pfd) == spec.item_bytes
    assert shared_run_bytes(spec, lf, pfd) == 32 * spec.item_bytes  # a page's tokens of a layer


def test_parser_and_main(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_bench_layouts_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(
        ["layouts", "--preset", "mla", "--page-size", "2", "--bytes", "1", "--repeats", "1",
         "--device", "cpu", "--json"]
    )  # fmt: skip
    rows = run_bench_layouts(args)
    assert len(rows) == 15 and all(r["preset"] == "mla" and r["pages"] == 1 for r in rows)
    assert main(["--preset", "odd", "--page-size", "2", "--bytes", "1", "--repeats", "1",
                 "--device", "cpu", "--json"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 15 and all(set(json.loads(line)) >= FIELDS for line in lines)


@pytest.mark.parametrize(
    "kwargs",
    [{"repeats": 0}, {"page_size": -1}, {"cpu_bytes": 0}, {"devices": ("tpu",)}],
)
def test_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        LayoutBenchConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        LayoutBenchConfig(devices=("cuda",))
