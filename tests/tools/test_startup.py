"""Startup of the ``hicache`` command: subcommands are imported only when named.

The store commands and ``backends`` run where only a store is at hand, so they must not pay the
second-long torch import; each is run here in a fresh interpreter, which then reports what it
imported. The listing of ``--help`` comes from the table in :mod:`hicache.tools.cli`, so it is
checked against what each subcommand's own parser says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from store_kit import StoreKit

from hicache.backends.file import FileBackend, FileConfig
from hicache.tools.bench.commands import BENCHMARKS, add_bench
from hicache.tools.cli import COMMANDS, build_parser, main
from hicache.tools.cli_parsing import chosen_command

# Runs CALL on the command line it is given, then prints, last, which heavy modules it imported.
_PROBE = """
import json, sys
from hicache.tools import cli
code = cli.CALL
heavy = ("torch", "numpy", "hicache.tools.serve.command", "hicache.tools.bench.commands")
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""
_HEAVY = {"torch", "hicache.tools.serve.command", "hicache.tools.bench.commands"}


def _probe(call: str, *argv: str) -> dict[str, Any]:
    """Run ``cli.<call>`` in a fresh interpreter: its result, and the heavy modules imported."""
    script = _PROBE.replace("CALL", call)
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A file store with a plain chain and a compressed one."""
    root = tmp_path_factory.mktemp("startup") / "store"

    async def fill() -> None:
        backend = await FileBackend.open(FileConfig(root=str(root)))
        kit = StoreKit(backend, root)
        await kit.chain(3, tenant="a")
        await kit.chain(2, tenant="b", compress=True)
        await backend.close()

    asyncio.run(fill())
    return f"file://{root}"


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["-v", "verify", "{url}", "--quiet"], id="verify"),
        # One process: the checks run in the probed interpreter, not in a worker pool.
        pytest.param(["verify", "{url}", "-q", "--processes", "1"], id="verify-in-process"),
        pytest.param(["inspect", "{url}", "--list", "--quiet"], id="inspect"),
        pytest.param(["compact", "{url}", "--dry-run", "--quiet"], id="compact"),
        pytest.param(["stats", "{url}"], id="stats"),
    ],
)
def test_store_commands_import_neither_torch_nor_numpy(store_url: str, argv: list[str]) -> None:
    result = _probe("main(sys.argv[1:])", *(a.format(url=store_url) for a in argv))
    # The file store's commands check compressed pages without decoding them: no numpy either.
    assert result["code"] == 0 and not set(result["imported"]) & (_HEAVY | {"numpy"})


def test_backends_does_not_import_torch() -> None:
    result = _probe("main(sys.argv[1:])", "backends", "--json")
    # numpy is allowed: listing loads every backend, and shm, mooncake and nixl import it.
    assert result["code"] == 0 and not set(result["imported"]) & _HEAVY


def test_help_imports_no_subcommand() -> None:
    assert _probe("build_parser([]).format_help()")["imported"] == []


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps long help lines
    for name, command in COMMANDS.items():
        assert f" {name} {command.help}" in out, name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_listing_matches_each_full_parser(name: str) -> None:
    """The help a bare entry shows is the one the subcommand's own parser gives."""
    assert build_parser([name]).format_help() == build_parser([]).format_help()


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_listing_matches_each_full_parser(name: str) -> None:
    def bench_help(rest: list[str]) -> str:
        sub = argparse.ArgumentParser(prog="hicache").add_subparsers()
        return add_bench(sub, rest).format_help()

    assert bench_help([name]) == bench_help([])


def test_a_named_subcommand_parses_in_full() -> None:
    args = build_parser(["-v", "compact", "u"]).parse_args(["-v", "compact", "u", "--grace", "1m"])
    assert args.command == "compact" and args.grace == 60 and args.verbose
    args = build_parser(["bench", "codec"]).parse_args(["bench", "codec", "--repeats", "2"])
    assert args.bench == "codec" and args.repeats == 2 and callable(args.bench_run)
    assert chosen_command(["-v", "--", "x"]) == "x" and chosen_command(["-h"]) is None


def test_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["nosuch"])
    assert exited.value.code == 2 and "invalid choice: 'nosuch'" in capsys.readouterr().err
