"""Bad values for the store, bench and config commands are one-line usage errors (exit 2) found
while parsing; a runtime failure exits 1 with one line; a traceback shows only with ``-v``."""

from __future__ import annotations

import json
import pathlib

import pytest
from cli_kit import run
from test_cli_store import build

from hicache.tools import cli_info


def usage_error(err: str) -> str:
    """The one error line after argparse's usage, checking there is nothing else."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), err
    assert lines[-1].startswith("hicache") and ": error: " in lines[-1], err
    return lines[-1]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("validation") / "s"
    build(root, damaged=False)
    return f"file://{root}"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["verify", "{url}", "--parallel", "0"], "--parallel"),
        (["verify", "{url}", "--parallel=-1"], "--parallel"),
        (["verify", "{url}", "--processes=-3"], "--processes"),
        (["verify", "{url}", "--prefix", "../"], "invalid key prefix"),
        (["inspect", "{url}", "--prefix", "../"], "invalid key prefix"),
        (["inspect", "{url}", "--format", "json", "--output", "{tmp}"], "is a directory"),
        (["compact", "{url}", "--parallel", "0", "--dry-run"], "--parallel"),
        (["compact", "{url}", "--grace", "9" * 400, "--dry-run"], "--grace"),
        (["stats", "{url}", "--count", "0"], "--count"),
        (["stats", "{url}", "--watch", "30d"], "--watch"),
        (["verify", "file:///tmp/x%00y"], "NUL"),
        (["bench", "codec", "--repeats", "0"], "--repeats"),
        (["bench", "codec", "--object-bytes", "0"], "--object-bytes"),
        (["bench", "codec", "--object-bytes", "255"], "--object-bytes"),
        (["bench", "backends", "--objects", "0"], "--objects"),
        (["bench", "backends", "--object-bytes", "-1"], "--object-bytes"),
        (["bench", "backends", "--dir", "{tmp}/missing"], "no such directory"),
        (["bench", "tools", "--small-objects", "0"], "--small-objects"),
        (["config", "--page-size", "0"], "--page-size"),
        (["config", "--host-ratio", "nan"], "NaN"),
        (["config", "--host-ratio", "inf"], "finite"),
        (["config", "--prefetch-timeout-max=-1"], "timeout_max_s"),
        (["config", "--host-pages", str(1 << 40)], "host_pages must be at most"),
        (["config", "--config", "{tmp}/missing.toml"], "no such file"),
    ],
    ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else None,
)
def test_bad_values_are_refused_while_parsing(
    argv: list[str],
    says: str,
    store: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, *(a.format(url=store, tmp=tmp_path) for a in argv))
    assert code == 2 and out == ""
    assert says in usage_error(err)


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("nan.json", '{"tiers": {"host_ratio": NaN}}', "NaN"),
        ("inf.json", '{"prefetch": {"timeout_base_s": Infinity}}', "finite"),
        ("nan.toml", "[tiers]\nhost_ratio = nan\n", "NaN"),
        ("neg.toml", "[prefetch]\ntimeout_per_1k_tokens_s = -0.5\n", "at least 0"),
        ("workers.toml", "[storage]\nworkers = 1000000\n", "workers must be at most 256"),
        ("queue.toml", "[storage]\nwrite_queue_pages = 1e3\n", "write_queue_pages"),
        ("shard.toml", '[storage]\nshard = "a/b"\n', "shard"),
        ("model.json", '{"storage": {"model_id": "\\ud800"}}', "model_id"),
        ("deep.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("binary.toml", None, "not UTF-8"),
    ],
)
def test_bad_config_files_are_one_line_errors(
    name: str,
    text: str | None,
    says: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / name
    if text is None:
        path.write_bytes(b"\xff\xfe" + bytes(range(256)))
    else:
        path.write_text(text)
    code, out, err = run(capsys, "config", "--config", str(path))
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("hicache: error: ") and says in err, err


def test_a_good_config_still_prints_what_takes_effect(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ok.toml"
    path.write_text("[tiers]\nhost_ratio = 3\n[storage]\nworkers = 256\n")
    code, out, _ = run(capsys, "config", "--config", str(path), "--prefetch-timeout-base", "0")
    table = json.loads(out)
    assert code == 0 and table["tiers"]["host_ratio"] == 3.0
    assert table["storage"]["workers"] == 256 and table["prefetch"]["timeout_base_s"] == 0.0


def test_the_smallest_codec_bench_reports_real_rates(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.tools.bench_codec import MIN_PAGE_BYTES
    from hicache.tools.cli_bench import CODEC_MIN_BYTES

    assert CODEC_MIN_BYTES == MIN_PAGE_BYTES  # the parser's bound is the benchmark's
    code, out, _ = run(
        capsys, "bench", "codec", "--object-bytes", "256", "--repeats", "1", "--json"
    )
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 2
    assert all(row["compress_gbps"] > 0 and row["ratio"] > 0 for row in rows)


def test_runtime_failures_exit_1_with_one_line_and_a_traceback_only_with_v(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_gone() -> list[dict[str, object]]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(cli_info, "_backend_rows", disk_gone)
    code, out, err = run(capsys, "backends")
    assert (code, out, err) == (1, "", "hicache: error: [Errno 5] Input/output error\n")

    def bug() -> list[dict[str, object]]:
        raise KeyError("schemes")

    monkeypatch.setattr(cli_info, "_backend_rows", bug)
    code, _, err = run(capsys, "backends")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("hicache: error: unexpected KeyError: 'schemes' (run with -v")
    code, _, err = run(capsys, "-v", "backends")
    assert code == 1 and "Traceback" in err and err.splitlines()[-1].startswith("hicache: error:")
