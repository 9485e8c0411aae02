"""``hicache serve`` when things go wrong: L3 failures show in the rows, a run that served nothing
exits 1 (with null TTFTs, never NaN), bad values are one-line usage errors (exit 2), and an error
mid-run leaves no task behind to print a traceback."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
from cli_kit import run
from serving_kit import VOCAB, keep_setups
from test_serving_bad_input import CHAT, TINY

from hicache.backends import registry
from hicache.backends.wrappers import FaultConfig, FaultInjectionBackend, FaultMode
from hicache.workloads.traces import TraceRequest, dump_trace

# One client of one round: the smallest run that serves a request.
ONE = ["--clients", "1", "--rounds", "1", "--system-tokens", "8", "--turn-tokens", "8", "-q"]


def one_line_error(err: str) -> str:
    """The error line of a failed command, checking there is nothing but it (and usage)."""
    assert "Traceback" not in err and "CancelledError" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    last = lines[-1]
    assert last.startswith(("hicache: error: ", "hicache serve: error: ")), err
    # Before it: argparse's usage (indented continuation lines), nothing else.
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), err
    return last


# ----- L3 failures in the rows -----------------------------------------------------------------
def test_l3_failures_in_the_row_equal_the_controllers_counters(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every L3 call fails (as with a full disk or a master that is down): the row says how many
    pages were not written and not read, exactly as the controller counted them."""
    opened = registry.open_backend
    faults = FaultConfig(fail_rate=1.0, fail_mode=FaultMode.RAISE)

    async def failing(url: str, **config: Any) -> FaultInjectionBackend:
        return FaultInjectionBackend(await opened(url, **config), faults)

    setups = keep_setups(monkeypatch)
    monkeypatch.setattr(registry, "open_backend", failing)
    argv = [*TINY, *CHAT, "--cache-dir", str(tmp_path / "l3")]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err  # every request was served, from device and host
    row = json.loads(out)["configs"][0]
    counts = setups[0].cache.metrics.counts
    assert row["l3_write_failures"] == counts["l3_write_failures"] > 0
    assert row["l3_read_failures"] == counts["l3_read_failures"] > 0
    assert row["errors"] == counts["errors"] + counts["timeouts"] > 0  # calls, not pages
    assert row["l3_unavailable"] == 0 and row["requests"] == 6
    # The table shows them too.
    code, out, _ = run(capsys, *argv)
    header, line = out.splitlines()[:2]
    assert header.endswith("errors L3 rd fail L3 wr fail L3 off"), header
    read, written, unavailable = (int(cell) for cell in line.split()[-3:])
    counts = setups[-1].cache.metrics.counts
    assert code == 0 and unavailable == 0
    assert (read, written) == (counts["l3_read_failures"], counts["l3_write_failures"])


def test_an_unreachable_l3_shows_in_the_row_and_fails_when_required(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    argv = [*TINY, *ONE, "--cache-dir", str(blocker / "l3"), "--json"]
    code, out, _ = run(capsys, *argv)
    row = json.loads(out)["configs"][0]
    assert code == 0 and row["l3_unavailable"] == 1 and row["requests"] == 1
    code, out, err = run(capsys, *argv, "--l3-required")
    assert code == 1 and out == ""  # a runtime failure, not a usage error
    assert "is required" in one_line_error(err)


# ----- nothing served ----------------------------------------------------------------------------
def _no_nan(text: str) -> dict[str, Any]:
    def refuse(name: str) -> float:
        raise AssertionError(f"{name} in the JSON output")

    result: dict[str, Any] = json.loads(text, parse_constant=refuse)
    return result


def test_a_run_where_every_request_fails_exits_1_without_nan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 1000 tokens to generate never fit a 128-token device pool: every request fails.
    argv = [*TINY, *ONE, "--output-tokens", "1000", "--l3", "none", "--compare", "--json"]
    code, out, err = run(capsys, *argv)
    assert code == 1
    assert "no request succeeded" in one_line_error(err) and "do not fit" in err
    result = _no_nan(out)
    assert result["outputs_identical"] is None  # nothing was compared
    for row in result["configs"]:
        assert row["requests"] == 0 and row["failed"] == 1
        assert row["ttft_p50_ms"] is None and row["ttft_mean_ms"] is None
    code, out, _ = run(capsys, *argv[:-1])  # the table shows '-' where a figure is missing
    assert code == 1 and "nan" not in out.lower() and out.splitlines()[1].split()[1] == "-"


def test_a_trace_of_out_of_vocabulary_tokens_exits_1(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "oov.jsonl"
    dump_trace([TraceRequest(f"r{i}", "", [VOCAB + i, 1], [0]) for i in range(3)], path)
    code, out, err = run(capsys, *TINY, "--trace", str(path), "--l3", "none", "--json")
    assert code == 1 and "token ids must be integers" in one_line_error(err)
    assert _no_nan(out)["configs"][0]["failed"] == 3


def test_an_empty_trace_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    code, out, err = run(capsys, *TINY, "--trace", str(path), "--l3", "none", "--json")
    assert code == 2 and out == "" and "holds no requests" in one_line_error(err)


def test_one_configuration_compares_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *TINY, *ONE, "--l3", "none", "--json")
    assert code == 0 and _no_nan(out)["outputs_identical"] is None
    code, out, _ = run(capsys, *TINY, *ONE, "--l3", "none")
    assert code == 0 and "outputs identical across configs: n/a" in out


# ----- usage errors ------------------------------------------------------------------------------
PAGES_16 = ["--page-size", "16", "--prefetch-threshold", "16"]


def _nested_trace(path: pathlib.Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")


def _binary_trace(path: pathlib.Path) -> None:
    path.write_bytes(bytes(range(255, -1, -1)) * 16)  # \xff first: never UTF-8


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--seed", "-1"], "--seed"),
        (["--chunk-tokens", "0"], "--chunk-tokens"),
        (["--host-ratio", "nan"], "NaN"),
        (["--host-ratio", "inf"], "finite"),
        (["--temperature", "nan"], "--temperature"),
        (["--layers", "99999999999"], "--layers"),
        (["--rate", "nan"], "--rate"),
        (["--rate", "1e-300"], "--rate"),
        (["--output-tokens", "99999999999"], "--output-tokens"),
        (["--l3", "file:///tmp/x%00y"], "NUL"),
        (["--prefetch-timeout-base", "-1"], "timeout_base_s"),
        (["--head-dim", "7"], "even"),
        (["--device-tokens", "130"], "multiple of --page-size"),
        ([*PAGES_16, "--window", "20"], "--window"),
        ([*PAGES_16, "--preset", "swa", "--window", "20"], "--window"),
        (["--preset", "swa", "--page-size", "48", "--prefetch-threshold", "48"], "--window"),
        ([*PAGES_16, "--state-interval", "24"], "--state-interval"),
        (["--preset", "hybrid", "--state-interval", "6"], "--state-interval"),
        (["--window", "0"], "--window"),
        (["--state-interval", str(1 << 31)], "--state-interval"),
        (["--vocab", str(1 << 32), "--hidden", str(1 << 16)], "GiB"),
        (["--trace", "{binary}"], "not UTF-8"),
        (["--trace", "{nested}"], "nested too deeply"),
        (["--trace", "{tmp}"], "not a regular file"),
        (["--plot", "{tmp}"], "is a directory"),
        (["--plot", "{tmp}/ttft"], ".png"),
        (["--config", "{workers}"], "workers must be at most 256"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_values_are_one_line_usage_errors(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    files = {"binary": tmp_path / "binary", "nested": tmp_path / "nested.jsonl"}
    _binary_trace(files["binary"])
    _nested_trace(files["nested"])
    workers = tmp_path / "workers.toml"
    workers.write_text(f'[storage]\nurl = "file://{tmp_path}/l3"\nworkers = 1000000\n')
    names = {**files, "tmp": tmp_path, "workers": workers}
    argv = [a.format(**names) for a in argv]
    started = time.monotonic()
    code, out, err = run(capsys, *TINY, *ONE, "--cache-dir", str(tmp_path / "l3"), *argv)
    assert code == 2 and out == "", err
    line = one_line_error(err)
    assert says in line, line
    assert "token ids" not in line  # --chunk-tokens 0 once blamed the tokens
    assert time.monotonic() - started < 10  # refused up front, not after a minute of workers
    assert not (tmp_path / "l3").exists()  # refused before anything was made


def test_every_float_flag_refuses_what_is_not_a_finite_number_in_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    floats = ["--rate", "--temperature", "--l3-bandwidth", "--host-ratio"]
    floats += ["--prefetch-timeout-base", "--prefetch-timeout-per-1k", "--prefetch-timeout-max"]
    for flag in floats:
        for value in ("nan", "inf", "-inf", "1e999", "-1"):
            code, _, err = run(capsys, *TINY, *ONE, "--l3", "none", f"{flag}={value}")
            assert code == 2 and flag in one_line_error(err), (flag, value)


# ----- an error mid-run --------------------------------------------------------------------------
# Runs `hicache` on the given arguments with an L3 that answers `exists` like a blocking client
# in a thread (a cancelled caller still waits for it), and an engine that fails while prefetches
# are asking it. The L3 calls the failure abandoned used to be cancelled by the event loop's
# shutdown, each printing a CancelledError traceback after the one-line error.
_FAIL_MID_RUN = """
import asyncio, sys, time
from hicache.backends import registry
from hicache.backends.wrappers.base import WrapperBackend
from hicache.serving.engine_events import AdmissionRound
from hicache.tools.serve import command as serve
from hicache.tools.cli import main

class SlowExists(WrapperBackend):
    async def _exists(self, keys):
        work = asyncio.gather(asyncio.to_thread(time.sleep, 0.2))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait([work])
            raise
        return await self.inner.exists(keys)

opened = registry.open_backend

async def slow(url, **config):
    return SlowExists(await opened(url, **config))

opened_engine = serve.open_engine

async def failing_engine(*args, **kwargs):
    setup = await opened_engine(*args, **kwargs)
    engine = setup.engine

    def fail(_):
        if engine.hiradix is not None and engine.hiradix.prefetcher.running:
            raise RuntimeError("injected failure")

    engine.observe(fail, AdmissionRound)
    return setup

registry.open_backend = slow
serve.open_engine = failing_engine
sys.exit(main(sys.argv[1:]))
"""


def test_an_error_mid_run_prints_one_line_and_no_task_traceback(tmp_path: pathlib.Path) -> None:
    argv = [*TINY, *CHAT, "--cache-dir", str(tmp_path / "l3"), "--json"]
    done = subprocess.run(
        [sys.executable, "-c", _FAIL_MID_RUN, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert one_line_error(done.stderr).startswith("hicache: error: unexpected RuntimeError")
    assert len(done.stderr.splitlines()) == 1, done.stderr
