"""``hicache bench seed`` at its smallest sizes: every field of each measurement, numbers finite
and positive where they must be, ``command`` strings that parse back to the same measurement
and sizes, and bad input refused with one line and exit 2. No figure is asserted: those are
the benchmark's, not a test's."""

from __future__ import annotations

import json
import math
import shlex
from typing import Any

import pytest
import torch
from cli_kit import run
from usage_kit import usage_error

from hicache.tools.cli import build_parser

# The smallest sizes of each measurement, with every flag that sizes it (so each command
# string must give them back).
SMALL = {
    "layout_host_io": ["--io-pages", "2", "--repeats", "1"],
    "slru_vs_lru": ["--slru-clients", "16", "--slru-rounds", "3", "--capacity-share", "0.3"],
    "delayer": ["--burst-conversations", "1", "--burst-turns", "2", "--repeats", "1"],
    "lpm_vs_fcfs": ["--lpm-clients", "8", "--lpm-rounds", "2", "--repeats", "1"],
    "decode_by_context": ["--contexts", "256,512", "--decode-tokens", "3"],
    "io_kernel": ["--kernel-pages", "2", "--repeats", "1"],
}
FIELDS = {
    "layout_host_io": {"ratio", "page_first_bytes_s", "layer_first_bytes_s"},
    "slru_vs_lru": {"ratio", "hit_rate_slru", "hit_rate_lru", "capacity_tokens"},
    "delayer": {"ttft_ratio", "hit_rate_with", "hit_rate_without"},
    "lpm_vs_fcfs": {
        "hit_tokens_ratio",
        "ttft_ratio",
        "lpm_hit_tokens_device",
        "lpm_hit_tokens_host",
        "fcfs_hit_tokens_device",
        "fcfs_hit_tokens_host",
    },
    "decode_by_context": {"context", "tok_s", "tok_s_hisparse", "tok_s_hisparse_vs_first"},
    "io_kernel": {"ratio", "gather", "scatter"} if torch.cuda.is_available() else {"skipped"},
}
# Fields that are a figure of work done, so must be finite and above zero.
POSITIVE = {
    "layout_host_io": ("ratio", "page_first_bytes_s", "layer_first_bytes_s"),
    "slru_vs_lru": ("ratio", "hit_rate_slru", "hit_rate_lru", "capacity_tokens"),
    "delayer": ("ttft_ratio", "hit_rate_with", "hit_rate_without"),
    "lpm_vs_fcfs": ("hit_tokens_ratio", "ttft_ratio", "lpm_ttft_mean_ms", "fcfs_ttft_mean_ms"),
    "decode_by_context": ("context", "tok_s", "tok_s_hisparse", "tok_s_vs_first"),
    "io_kernel": ("ratio",) if torch.cuda.is_available() else (),
}


def seed_json(capsys: pytest.CaptureFixture[str], name: str) -> dict[str, Any]:
    code, out, err = run(capsys, "bench", "seed", "--only", name, *SMALL[name], "--json")
    assert code == 0, err
    assert len(out.splitlines()) == 1  # one JSON object
    result: dict[str, Any] = json.loads(out)
    assert list(result) == [name]
    return result


def check_command(command: str, name: str, context: int | None = None) -> None:
    """``command`` parses through the same parser to this measurement at the same sizes."""
    argv = shlex.split(command)
    assert argv[0] == "hicache"
    args = build_parser(argv[1:]).parse_args(argv[1:])
    assert args.only == [name] and args.json
    small = build_parser(["bench", "seed"]).parse_args(["bench", "seed", *SMALL[name]])
    for flag in SMALL[name][::2]:
        dest = flag[2:].replace("-", "_")
        expected = getattr(small, dest)
        if dest == "contexts" and context is not None:
            expected = [context]
        assert getattr(args, dest) == expected, flag


def check_object(row: dict[str, Any], name: str) -> None:
    assert FIELDS[name] <= set(row), FIELDS[name] - set(row)
    assert row["seed"]
    for key in POSITIVE[name]:
        value = row[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, key


@pytest.mark.parametrize("name", ["layout_host_io", "slru_vs_lru", "io_kernel"])
def test_cache_measurements(capsys: pytest.CaptureFixture[str], name: str) -> None:
    row = seed_json(capsys, name)[name]
    check_object(row, name)
    check_command(row["command"], name)


def test_slru_capacity_forces_eviction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    row = seed_json(capsys, "slru_vs_lru")["slru_vs_lru"]
    # a capacity under the unique tokens forces eviction, so neither reaches the unbounded rate
    assert row["evicted_tokens_slru"] > 0 and row["evicted_tokens_lru"] > 0
    assert max(row["hit_rate_slru"], row["hit_rate_lru"]) < row["hit_rate_unbounded"]
    assert row["ratio"] == round(row["hit_rate_slru"] / row["hit_rate_lru"], 3)


@pytest.mark.parametrize("name", ["delayer", "lpm_vs_fcfs"])
def test_serve_measurements(capsys: pytest.CaptureFixture[str], name: str) -> None:
    row = seed_json(capsys, name)[name]
    check_object(row, name)
    check_command(row["command"], name)
    assert row["serve_command"].count("hicache serve") == 1


def test_lpm_trace_sends_shared_prefixes_to_host(capsys: pytest.CaptureFixture[str]) -> None:
    """The device pool holds one document: FCFS, serving the documents interleaved, finds some
    of them evicted to host, the premise of the comparison."""
    row = seed_json(capsys, "lpm_vs_fcfs")["lpm_vs_fcfs"]
    assert row["fcfs_hit_tokens_host"] > 0
    assert row["documents"] == 2 and row["requests"] == 16


def test_decode_by_context_is_a_list_of_points(capsys: pytest.CaptureFixture[str]) -> None:
    points = seed_json(capsys, "decode_by_context")["decode_by_context"]
    assert [p["context"] for p in points] == [256, 512]
    assert points[0]["tok_s_vs_first"] == 1.0
    for point in points:
        check_object(point, "decode_by_context")
        check_command(point["command"], "decode_by_context", point["context"])
        assert point["outputs_identical"] is True


def test_table_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "bench", "seed", "--only", "slru_vs_lru", "io_kernel")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split(" | ") == ["measurement", "ours", "seed", "command"]
    assert [row.split(" | ")[0] for row in rows] == ["slru_vs_lru", "io_kernel"]
    command = "hicache bench seed --only io_kernel --kernel-pages 128 --repeats 5 --json"
    assert rows[1].split(" | ")[3] == command


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--only", "bogus"], "invalid choice: 'bogus'"),
        (["--capacity-share", "0"], "--capacity-share"),  # an open bound
        (["--contexts", "0"], "--contexts"),
        (["--contexts", "4096,4096"], "--contexts"),
        (["--contexts", "4096,x"], "--contexts"),
        (["--only", "decode_by_context", "--contexts", "4096,262144"], "--contexts 262144"),
        (["--only", "decode_by_context", "--contexts", "100"], "--contexts 100"),
        (["--only", "delayer", "--burst-turns", "40"], "--burst-turns 40"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    """Values past a flag's bounds: tests/tools/test_cli_validation.py, for every flag."""
    code, out, err = run(capsys, "bench", "seed", *argv, "--json")
    assert code == 2 and out == ""
    assert says in usage_error(err)
