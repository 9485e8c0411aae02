"""Bad values for the store, bench and config commands are one-line usage errors (exit 2) found
while parsing; a runtime failure exits 1 with one line; a traceback shows only with ``-v``."""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import pytest
from cli_kit import run
from test_cli_store import build
from usage_kit import usage_error

from hicache.tools import cli_info
from hicache.tools.cli import build_parser


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
        (["bench", "backends", "--dir", "{tmp}/missing"], "no such directory"),
        (["bench", "radix", "--page-size", "nan"], "--page-size"),
        (["bench", "radix", "--capacity-share", "nan"], "--capacity-share"),
        (["bench", "radix", "--capacity-share", "0"], "--capacity-share"),  # an open bound
        (["bench", "radix", "--trace", "{tmp}"], "not a regular file"),
        (["bench", "layouts", "--bytes", "inf"], "--bytes"),
        (["bench", "controller", "--sequences", "1e9"], "--sequences"),
        (["bench", "controller", "--dir", "{tmp}/missing"], "no such directory"),
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


def _bench_flags(name: str) -> list[argparse.Action]:
    parser = build_parser(["bench", name])
    for word in ("bench", name):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return [a for a in parser._actions if a.option_strings and a.type is not None]


@pytest.mark.parametrize(
    "name", ["codec", "backends", "tools", "radix", "layouts", "controller", "seed"]
)
def test_a_value_past_either_bound_of_a_bench_flag_is_refused(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Just below and just above the range a flag's type declares: a usage error naming the
    flag. (Text that is not a number, and paths: the cases of the test above.)"""
    checked = 0
    for action in _bench_flags(name):
        bounds = getattr(action.type, "bounds", None)
        if bounds is None:  # a path or a name: nothing to be past
            continue
        flag = action.option_strings[-1]
        for value in (bounds[0] - 1, bounds[1] + 1):
            code, out, err = run(capsys, "bench", name, f"{flag}={value}")
            assert (code, out) == (2, ""), f"bench {name} {flag}={value}"
            assert flag in usage_error(err)
        checked += 1
    assert checked >= 2, (
        f"bench {name}: {checked} bounded flags (every bench has --repeats and more)"
    )


@pytest.mark.parametrize("name", ["radix", "layouts", "controller"])
def test_every_typed_flag_of_the_benches_with_their_own_parsers_is_checked(name: str) -> None:
    """A plain ``type=int`` or ``float`` takes NaN, negatives and sizes no machine holds."""
    for action in _bench_flags(name):
        flag = action.option_strings[-1]
        bounds = getattr(action.type, "bounds", None)
        if getattr(action.type, "__name__", "") in ("file", "directory"):  # paths, checked too
            continue
        assert bounds is not None, f"bench {name} {flag}: its value is not range-checked"
        assert all(math.isfinite(b) for b in bounds), flag
        if action.default is not None:
            assert bounds[0] <= action.default <= bounds[1], flag


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["radix", "--clients", "100000", "--rounds", "1000"], "--clients 100000 and --rounds"),
        (["radix", "--workload", "longdoc", "--match-scaling", "1000"], "lower them"),
        (["controller", "--overhead-pages", "4096", "--sequences", "4096"], "at most"),
        (["layouts", "--bytes", "1T", "--device", "cpu"], "4 x --bytes"),
    ],
)
def test_bench_sizes_too_large_together_are_refused_before_a_run(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "bench", *argv)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith("hicache: error: ") and says in err


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
    from hicache.tools.bench.cache.codec import MIN_PAGE_BYTES

    code, out, _ = run(
        capsys, "bench", "codec", "--object-bytes", str(MIN_PAGE_BYTES), "--repeats", "1", "--json"
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
