"""Bad requests fail alone, bad traces are refused with the line named, and ``hicache serve``
runs end to end (all four cache configurations, no L3, trace replay)."""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import pytest
from serving_kit import DEVICE_TOKENS, VOCAB, hicache_config, serve, trace

from hicache.backends.registry import open_backend
from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode
from hicache.serving.request import ServeRequest
from hicache.tools.cli import main
from hicache.workloads.traces import TraceRequest, dump_trace

OUT = 3


class Batch:
    """Requests all arriving at once, as built (``TraceReplay`` cannot ask for 0 tokens)."""

    def __init__(self, requests: list[ServeRequest]) -> None:
        self._requests = requests

    def due(self, now: float) -> list[ServeRequest]:
        due, self._requests = self._requests, []
        return due

    def finished(self, request: ServeRequest, now: float) -> None:
        return None

    def next_arrival(self) -> float | None:
        return 0.0 if self._requests else None


def _good(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % VOCAB for i in range(n)]


def _requests(bad: bool) -> list[ServeRequest]:
    good = [
        ServeRequest("good-0", _good(0, 30), OUT),
        ServeRequest("good-1", _good(0, 20) + _good(1, 9), OUT),  # shares a prefix with good-0
        ServeRequest("fits-exactly", _good(2, DEVICE_TOKENS - OUT), OUT),
    ]
    if not bad:
        return good
    return [
        ServeRequest("empty", [], OUT),
        good[0],
        ServeRequest("out-of-vocab", [1, 2, VOCAB], OUT),
        ServeRequest("negative", [-1, 2, 3], OUT),
        good[1],
        ServeRequest("too-long", _good(3, DEVICE_TOKENS - OUT + 1), OUT),
        ServeRequest("no-output", [1, 2, 3], 0),
        good[2],
    ]


ERRORS = {
    "empty": "empty prompt",
    "out-of-vocab": f"[0, {VOCAB})",
    "negative": f"[0, {VOCAB})",
    "too-long": "do not fit the device pool",
    "no-output": "max_new_tokens",
}


@pytest.mark.parametrize("mode", [CacheMode.NONE, CacheMode.DEVICE_HOST_L3], ids=lambda m: m.name)
async def test_bad_requests_fail_alone(mode: CacheMode, tmp_path: pathlib.Path) -> None:
    preset = ModelPreset.DENSE
    config = hicache_config(tmp_path / "l3")
    want = await serve(preset, CacheMode.NONE, Batch(_requests(bad=False)))
    got = await serve(preset, mode, Batch(_requests(bad=True)), config)
    records = {r.rid: r for r in got.records}
    assert len(records) == len(_requests(bad=True))
    for rid, problem in ERRORS.items():
        error = records[rid].error
        assert error is not None and problem in error, (rid, error)
        assert records[rid].first_token_s is None and records[rid].output_tokens == 0
    for rid in want.outputs:
        assert records[rid].error is None and records[rid].output_tokens == OUT
    # The failures changed nothing for the others: same tokens as a run without them.
    assert got.outputs == want.outputs


# ----- hicache serve ---------------------------------------------------------------------------

TINY = [
    "serve", "--device", "cpu", "--layers", "2", "--hidden", "32", "--heads", "2",
    "--kv-heads", "1", "--head-dim", "8", "--vocab", str(VOCAB), "--page-size", "4",
    "--device-tokens", "128", "--max-running", "2", "--prefetch-threshold", "4",
]  # fmt: skip
CHAT = ["--clients", "3", "--rounds", "2", "--system-tokens", "16", "--turn-tokens", "8",
        "--output-tokens", "2"]  # fmt: skip
ROW_KEYS = {
    "ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms", "throughput_tok_s", "hit_tokens_device",
    "hit_tokens_host", "hit_tokens_l3", "prompt_tokens", "hit_rate",
}  # fmt: skip


def _serve_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main([*TINY, *args, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_cli_compare_runs_four_configs(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    l3 = tmp_path / "l3"
    result = _serve_json(capsys, *CHAT, "--cache-dir", str(l3), "--compare")
    rows = result["configs"]
    assert [r["name"] for r in rows] == ["none", "device", "device+host", "device+host+l3"]
    assert result["outputs_identical"] is True
    assert result["l3"] == f"disk://{l3}"
    oracle = result["oracle_hit_rate"]
    assert 0 < oracle < 1
    for row in rows:
        assert set(row) >= ROW_KEYS, ROW_KEYS - set(row)
        assert row["requests"] == 6 and row["failed"] == 0 and row["errors"] == 0
        assert row["prompt_tokens"] == rows[0]["prompt_tokens"]
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"]
        saved = row["hit_tokens_device"] + row["hit_tokens_host"] + row["hit_tokens_l3"]
        assert row["hit_rate"] == round(saved / row["prompt_tokens"], 4)
        assert row["hit_rate"] <= oracle  # nothing beats an unbounded cache from cold
    assert rows[0]["hit_rate"] == 0
    assert rows[1]["hit_tokens_device"] > 0
    assert rows[3]["bytes_host_to_l3"] > 0, "the L3 config wrote no pages"
    # ... in a namespace of the run's own, deleted when it ended
    assert rows[3]["l3_discarded_objects"] > 0
    # (a disk store keeps its marker, logs and locks; every segment held the run's pages)
    assert not any(p.is_file() for p in (l3 / "segments").rglob("*"))


def test_cli_restart_reads_l3(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    """Runs with --l3-warm share the model's L3 namespace: the second reads what the first
    wrote. A run without it starts from an empty namespace of its own (reproducible)."""
    args = [*CHAT, "--cache-dir", str(tmp_path / "l3")]

    def stored() -> list[str]:
        """The keys the default L3 (a disk store in the cache dir) holds, read-only."""

        async def keys() -> list[str]:
            url = f"disk://{tmp_path / 'l3'}?read_only=true"
            async with await open_backend(url) as store:
                return sorted([info.key async for info in store.scan()])

        return asyncio.run(keys())

    first = _serve_json(capsys, *args, "--l3-warm")
    kept = stored()
    cold = _serve_json(capsys, *args)
    warm = _serve_json(capsys, *args, "--l3-warm")
    assert [r["name"] for r in warm["configs"]] == ["device+host+l3"]
    assert first["configs"][0]["hit_tokens_l3"] == 0 and first["l3_warm"] is True
    assert cold["configs"][0]["hit_tokens_l3"] == 0 and cold["l3_warm"] is False
    assert warm["configs"][0]["hit_tokens_l3"] > 0 and warm["l3_warm"] is True
    # The cold run's own namespace is gone when it ends; the warm runs' pages stay.
    assert kept and stored() == kept
    assert cold["configs"][0]["l3_discarded_objects"] == len(kept)
    assert "l3_discarded_objects" not in warm["configs"][0]


def test_cli_dump_outputs(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    """--dump-outputs writes one JSON line per request, the tokens the run generated."""
    dump = tmp_path / "outputs.jsonl"
    args = [*CHAT, "--l3", "none", "--compare", "--dump-outputs", str(dump)]
    result = _serve_json(capsys, *args)
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [set(line) for line in lines] == [{"id", "output_tokens"}] * len(lines)
    assert len(lines) == result["configs"][-1]["requests"] > 0
    assert [line["id"] for line in lines] == sorted(line["id"] for line in lines)
    assert all(len(line["output_tokens"]) == 2 for line in lines)  # CHAT asks for 2
    again = tmp_path / "again.jsonl"
    _serve_json(capsys, *args[:-1], str(again))
    assert again.read_text() == dump.read_text()  # same tokens run after run
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # its directory must exist: refused while parsing
        main([*TINY, *CHAT, "--l3", "none", "--dump-outputs", str(tmp_path / "no" / "x")])
    assert exited.value.code == 2 and "--dump-outputs" in capsys.readouterr().err


def test_cli_without_l3(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    l3 = tmp_path / "l3"
    result = _serve_json(capsys, *CHAT, "--cache-dir", str(l3), "--l3", "none", "--compare")
    assert result["l3"] is None
    assert [r["name"] for r in result["configs"]] == ["none", "device", "device+host"]
    assert all(r["hit_tokens_l3"] == 0 for r in result["configs"])
    assert result["outputs_identical"] is True
    assert not l3.exists(), "no L3 was asked for, yet the cache directory was made"


def _write_trace(path: pathlib.Path) -> list[TraceRequest]:
    shared = [(i * 37) % VOCAB for i in range(24)]
    requests = [
        TraceRequest(f"r{i}", "tenant-a", shared + [(i * 5 + j) % VOCAB for j in range(6)], [0, 0])
        for i in range(4)
    ]
    requests.append(TraceRequest("bad-token", "tenant-a", [1, VOCAB + 5], [0]))
    dump_trace(requests, path)
    return requests


def test_cli_replays_a_trace(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write_trace(path)
    args = ["--trace", str(path), "--cache-dir", str(tmp_path / "l3"), "--compare"]
    result = _serve_json(capsys, *args)
    assert result["outputs_identical"] is True
    for row in result["configs"]:
        assert row["requests"] == 4 and row["failed"] == 1  # the out-of-vocab request
        assert row["prompt_tokens"] == 4 * 30
    assert result["configs"][1]["hit_tokens_device"] > 0  # the shared 24-token prefix


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"id": "x", "namespace": "", "tokens": [1, 2', "not JSON"),
        ('{"id": "x", "namespace": "", "tokens": [1, 2]}', "missing field 'output_tokens'"),
    ],
    ids=["not-json", "missing-field"],
)
def test_cli_refuses_a_bad_trace_line(
    line: str, problem: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "trace.jsonl"
    good = '{"id": "ok", "namespace": "", "tokens": [1, 2, 3], "output_tokens": [4]}'
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    code = main([*TINY, "--trace", str(path), "--cache-dir", str(tmp_path / "l3"), "--json"])
    captured = capsys.readouterr()
    assert code == 2
    assert "trace line 3" in captured.err and problem in captured.err
    assert captured.out == ""


def test_cli_missing_trace_file(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SystemExit) as exited:  # a usage error, found while parsing
        main([*TINY, "--trace", str(missing), "--l3", "none", "--json"])
    assert exited.value.code == 2 and str(missing) in capsys.readouterr().err


@pytest.mark.parametrize("preset", [ModelPreset.DENSE, ModelPreset.SWA, ModelPreset.HYBRID])
async def test_a_one_token_prompt_is_served(preset: ModelPreset, tmp_path: pathlib.Path) -> None:
    """A one-token prompt has no page to reuse (its key is empty): it is scheduled and served
    beside others, in every mode, with the outputs of no cache."""
    prompts = [[5], _good(1, 19), [7]]
    want = await serve(preset, CacheMode.NONE, trace(prompts))
    assert not want.errors and len(want.outputs) == 3
    for mode in (CacheMode.DEVICE, CacheMode.DEVICE_HOST_L3):
        config = hicache_config(tmp_path / mode.name)
        got = await serve(preset, mode, trace(prompts), config)
        assert got.outputs == want.outputs and not got.errors, mode
