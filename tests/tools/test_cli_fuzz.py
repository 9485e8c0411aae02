"""Random values for every flag of ``hicache serve`` and of the store, config and bench commands:
each case ends, within a time bound, in a run or in one error line. Never a traceback, an
exception nobody raised on purpose, NaN in the JSON, or a hang.

The flags come from the parsers themselves, so a new flag is fuzzed without a change here. Each
case runs ``cli.main`` in this process, on a thread (a case that does not end in
``CASE_TIMEOUT_S`` fails as a hang), around small fixed sizes (a one-layer model, one request,
no L3) so that what parses runs in milliseconds. Values that are valid but only make the work
longer (a thousand clients, one arrival a minute) are not drawn: they are slow, not wrong.

The benchmarks that take seconds at any size (``bench radix``, ``layouts``, ``controller``)
are only parsed: a case is a usage error, or values that are each finite and within the
bounds their flag's type declares (a flag without bounds fails).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import math
import os
import pathlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_cli_store import build

from hicache.tools import cli_parsing
from hicache.tools.cli import build_parser, main
from hicache.typed_config import parse_duration, parse_size

pytestmark = pytest.mark.slow

CASE_TIMEOUT_S = 60.0
# The fixed sizes around a fuzzed serve flag: later flags win, so the fuzzed one overrides.
SERVE = [
    "serve", "--device", "cpu", "--layers", "1", "--hidden", "16", "--heads", "2",
    "--kv-heads", "1", "--head-dim", "8", "--vocab", "64", "--page-size", "4",
    "--device-tokens", "64", "--max-running", "2", "--clients", "1", "--rounds", "1",
    "--system-tokens", "4", "--turn-tokens", "4", "--output-tokens", "1",
    "--prefetch-threshold", "4", "--l3", "none", "--json", "-q",
]  # fmt: skip
# Valid values above these only make a run longer; "<" marks flags that are slow below.
SLOW_ABOVE: dict[str, float] = {
    "--clients": 16, "--rounds": 16, "--system-tokens": 4096, "--turn-tokens": 4096,
    "--output-tokens": 4096, "--count": 16, "--repeats": 4, "--objects": 64,
    "--object-bytes": 1 << 20, "--small-objects": 64, "--large-objects": 8,
    "--small-bytes": 1 << 16, "--large-bytes": 1 << 20, "--processes": 4, "--watch": 0.1,
}  # fmt: skip
SLOW_BELOW: dict[str, float] = {"--rate": 20.0, "--l3-bandwidth": 10.0}
NASTY = [
    "nan", "-inf", "1e999", "-1", "0", str(10**30), "9" * 5000, "", "x", "\udcff", "١٢",
    "{binary}", "{dir}", "file:///tmp/x%00y",
]  # fmt: skip


@dataclass
class Command:
    """A command line to fuzz: its fixed words and the flags its parser has."""

    name: str
    base: list[str]
    flags: list[argparse.Action] = field(default_factory=list)


# Commands that are parsed, not run (see the module docstring).
PARSE_ONLY = {("bench", "radix"), ("bench", "layouts"), ("bench", "controller")}


@dataclass
class Outcome:
    code: Any
    out: str
    err: str
    seconds: float
    tracebacks: list[str]
    parsed: argparse.Namespace | None = None  # a parse-only case that parsed


class _Tracebacks(logging.Handler):
    """Log records that carry a traceback: on the real CLI each would print one."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.seen.append(f"{record.name}: {record.getMessage()}")


@dataclass
class Bench:
    """The scratch files and commands of the module's cases."""

    files: dict[str, str]
    commands: dict[str, Command]
    tracebacks: _Tracebacks
    cases: int = 0


def _flags(words: list[str]) -> list[argparse.Action]:
    """The optional arguments of the (sub)command ``words`` names, from its own parser."""
    parser = build_parser(words)
    for word in words:
        if word.startswith("-") or "://" in word:
            break
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def _files(root: pathlib.Path) -> dict[str, str]:
    (root / "binary").write_bytes(bytes(range(255, -1, -1)) * 64)
    (root / "nested.jsonl").write_text("[" * 50_000 + "]" * 50_000 + "\n")
    (root / "empty.jsonl").write_text("")
    good = '{"id": "a", "namespace": "", "tokens": [1, 2, 3], "output_tokens": [4]}\n'
    (root / "trace.jsonl").write_text(good)
    (root / "oov.jsonl").write_text(good.replace("[1, 2, 3]", "[1, 99999]"))
    (root / "ok.toml").write_text(f'[storage]\nurl = "file://{root}/l3"\n[tiers]\nhost_ratio = 1\n')
    (root / "nan.json").write_text('{"tiers": {"host_ratio": NaN}}')
    (root / "dir").mkdir()
    build(root / "store", damaged=False)
    return {
        "binary": str(root / "binary"),
        "dir": str(root / "dir"),
        **{p.stem: str(p) for p in root.glob("*.*")},
        "plot": str(root / "dir" / "ttft.png"),
        "store": f"file://{root}/store",
        "l3": f"file://{root}/l3",
        "missing": f"file://{root}/missing",
    }


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    root = tmp_path_factory.mktemp("fuzz")
    files = _files(root)
    store = files["store"]
    bases = {
        "serve": [*SERVE, "--cache-dir", str(root / "cache")],
        "verify": ["verify", store, "-q", "--processes", "1"],
        "inspect": ["inspect", store, "-q"],
        "compact": ["compact", store, "-q", "--dry-run"],
        "stats": ["stats", store, "--watch", "0", "--count", "1"],
        "config": ["config"],
        "bench codec": ["bench", "codec", "--object-bytes", "256", "--repeats", "1", "--json"],
        "bench backends": ["bench", "backends", "--backend", "memory", "--objects", "1",
                           "--object-bytes", "64", "--repeats", "1", "--json"],
        "bench tools": ["bench", "tools", "--small-objects", "2", "--large-objects", "1",
                        "--small-bytes", "4K", "--large-bytes", "64K", "--repeats", "1",
                        "--json"],
        **{" ".join(words): list(words) for words in sorted(PARSE_ONLY)},
    }  # fmt: skip
    commands = {name: Command(name, base, _flags(base)) for name, base in bases.items()}
    handler = _Tracebacks()
    logging.getLogger().addHandler(handler)
    cwd = os.getcwd()
    os.chdir(root / "dir")  # what a garbage relative path makes lands here
    memory = cli_parsing.host_memory
    cli_parsing.host_memory = lambda: 1 << 30  # a valid size allocates at most 1 GiB
    fuzz = Bench(files, commands, handler)
    for argv in bases.values():  # import what each command imports, before the freeze
        run_case(fuzz, [*argv, "--help"])
    gc.freeze()  # what is loaded now is never collected: each case's collection is quick
    try:
        yield fuzz
    finally:
        gc.unfreeze()
        cli_parsing.host_memory = memory
        os.chdir(cwd)
        print(f"\n{fuzz.cases} fuzz cases")
        logging.getLogger().removeHandler(handler)


def run_case(bench: Bench, argv: list[str]) -> Outcome:
    """``hicache argv`` on a thread; fails as a hang when it does not end in time."""
    out, err, box = io.StringIO(), io.StringIO(), {}
    bench.tracebacks.seen.clear()
    parse_only = tuple(argv[:2]) in PARSE_ONLY

    def target() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if parse_only:
                    box["parsed"] = build_parser(argv).parse_args(argv)
                    box["code"] = 0
                else:
                    box["code"] = main(argv)
            except SystemExit as exc:  # argparse's: nothing ran
                box["code"], box["parsed"] = exc.code, False
            except BaseException as exc:  # escaped main: a traceback on the real CLI
                box["code"] = f"raised {type(exc).__name__}: {exc}"

    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(CASE_TIMEOUT_S)
    assert not thread.is_alive(), f"hang: no end after {CASE_TIMEOUT_S} s: {argv}"
    ran = box.get("parsed", True) is not False and not parse_only
    if ran and argv[0] != "config" and argv[:2] != ["bench", "codec"]:
        # An event loop ran. What it left unretrieved ("exception was never retrieved") is
        # logged when collected: collect now, so the case that left it is the one that fails.
        gc.collect()
    bench.cases += 1
    seconds = time.monotonic() - started
    parsed = box.get("parsed")
    return Outcome(
        box.get("code"),
        out.getvalue(),
        err.getvalue(),
        seconds,
        bench.tracebacks.seen,
        parsed if isinstance(parsed, argparse.Namespace) else None,
    )


_ERROR_LINE = re.compile(r"hicache( [a-z]+)*: error: ")


def check(outcome: Outcome, argv: list[str]) -> None:
    """A run (0, or 1 for a run that failed) or one error line; never a traceback."""
    where = f"{argv}\nstderr: {outcome.err[-2000:]}"
    assert outcome.code in (0, 1, 2), f"exit {outcome.code!r}: {where}"
    assert "Traceback" not in outcome.err, where
    assert not outcome.tracebacks, f"{outcome.tracebacks}: {where}"
    verify_found_bad = argv[0] == "verify" and outcome.code == 1 and not outcome.err.strip()
    if outcome.code != 0 and not verify_found_bad:  # verify's report is on stdout
        lines = [line for line in outcome.err.splitlines() if line.strip()]
        assert lines and _ERROR_LINE.match(lines[-1]), where
        assert "unexpected" not in lines[-1], where  # an exception nobody raised on purpose
    if argv[0] == "serve" and outcome.out.strip():

        def no_nan(name: str) -> float:
            raise AssertionError(f"{name} in the output: {where}")

        json.loads(outcome.out, parse_constant=no_nan)
    if outcome.parsed is not None:
        check_parsed(outcome.parsed, _flags(argv[:2]), where)


def check_parsed(args: argparse.Namespace, flags: list[argparse.Action], where: str) -> None:
    """Each number a parse-only command accepted is finite and within its flag's bounds."""
    for action in flags:
        value = getattr(args, action.dest)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = action.option_strings[-1]
        bounds = getattr(action.type, "bounds", None)
        assert bounds is not None, f"{flag} takes {value!r} unchecked: {where}"
        assert math.isfinite(value) and bounds[0] <= value <= bounds[1], f"{flag}: {where}"


def _number(text: str) -> float | None:
    for parse in (float, parse_size, parse_duration):
        with contextlib.suppress(ValueError, OverflowError):
            return float(parse(text))
    return None


def slow(action: argparse.Action, text: str) -> bool:
    """Whether ``text`` is a valid value of ``action`` that only makes the work long."""
    flag = action.option_strings[-1]
    bounds = getattr(action.type, "bounds", None)
    value = _number(text)
    if value is None or (bounds is not None and not bounds[0] <= value <= bounds[1]):
        return False  # refused, or not a number
    if flag in SLOW_BELOW:
        return 0 < value < SLOW_BELOW[flag]
    return flag in SLOW_ABOVE and value > SLOW_ABOVE[flag]


def words(action: argparse.Action, text: str | None) -> list[str]:
    """The command-line words that give ``action`` the value ``text`` (None: the bare flag)."""
    flag = action.option_strings[-1]
    if text is None or action.nargs == 0:
        return [flag]
    return [f"{flag}={text}"]  # the = form: a value may start with "-"


def _expand(text: str, files: dict[str, str]) -> str:
    for name, path in files.items():
        text = text.replace("{" + name + "}", path)
    if not text.startswith(tuple(files.values())):  # never a real system path: garbage stays
        if text.startswith(("/", "~")):  # under the scratch dir
            text = "./" + text
        if "%00" not in text:  # file:///tmp/x%00y is refused; another file:/// could write
            text = text.replace(":///", "://")
    return text


# ----- every flag, a fixed list of nasty values --------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "serve", "verify", "inspect", "compact", "stats", "config",
        "bench codec", "bench backends", "bench tools",
        "bench radix", "bench layouts", "bench controller",
    ],
)  # fmt: skip
def test_every_flag_with_nasty_values(name: str, bench: Bench) -> None:
    command = bench.commands[name]
    for action in command.flags:
        for nasty in [None, *NASTY] if action.nargs != 0 else [None, "x"]:
            text = None if nasty is None else _expand(nasty, bench.files)
            if text is not None and slow(action, text):
                continue
            argv = [*command.base, *words(action, text)]
            check(run_case(bench, argv), argv)


def test_store_urls(bench: Bench) -> None:
    """The positional URL of the store commands, nasty too."""
    urls = ["", "x", "nosuch://x", "memory://", "file://", "file://relative", "file:///tmp/x%00y"]
    urls += [bench.files["missing"], f"file://{bench.files['binary']}", "\udcff://x"]
    for name in ("verify", "inspect", "compact", "stats"):
        base = bench.commands[name].base
        for url in urls:
            argv = [base[0], url, *base[2:]]
            check(run_case(bench, argv), argv)


# ----- random values, one to three flags at a time -----------------------------------------------
_TEXT = st.one_of(
    st.integers(-5, 20).map(str),
    st.integers().map(str),
    st.sampled_from([1023, 1024, 1025, 4096, 65536, 65537, 1 << 20, 1 << 30, 1 << 32]).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(0, 100).map(str),
    st.sampled_from(["nan", "inf", "-inf", "-0.0", "1e-300", "1e300", "2M", "64K", "1.5G"]),
    st.sampled_from(["12h", "7d", "0.01", "30s", "none", "off", "true", "write_back"]),
    st.text(max_size=12),
    st.sampled_from(["{binary}", "{dir}", "{nested}", "{empty}", "{trace}", "{oov}", "{ok}"]),
    st.sampled_from(["{nan}", "{plot}", "{l3}", "{missing}", "memory://"]),  # never {store}
)


@st.composite
def cases(draw: st.DrawFn, commands: dict[str, Command], files: dict[str, str]) -> list[str]:
    command = commands[draw(st.sampled_from(sorted(commands)))]
    argv = list(command.base)
    for action in draw(st.lists(st.sampled_from(command.flags), min_size=1, max_size=3)):
        text = None if action.nargs == 0 else _expand(draw(_TEXT), files)
        if text is None or not slow(action, text):  # a slow value: the base's stays
            argv += words(action, text)
    return argv


# HICACHE_FUZZ_EXAMPLES=N: N fresh random cases instead of the fixed ones (a deeper local run).
_DEEP = int(os.environ.get("HICACHE_FUZZ_EXAMPLES", "0"))


def test_random_values_for_random_flags(bench: Bench) -> None:
    @settings(
        max_examples=_DEEP or 500,
        deadline=None,
        derandomize=not _DEEP,  # the same cases on every run: a failure reproduces
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a hang would take minutes
    )
    @given(cases(bench.commands, bench.files))
    def one(argv: list[str]) -> None:
        check(run_case(bench, argv), argv)

    one()
