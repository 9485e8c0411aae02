"""The store commands end to end through ``cli.main``: output, exit codes, bad input."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pathlib

import pytest
from store_kit import StoreKit

from hicache.backends.file import FileBackend, FileConfig
from hicache.codec import HEADER_SIZE
from hicache.tools.cli import main
from hicache.tools.progress import Progress


def build(root: pathlib.Path, damaged: bool = True) -> tuple[list[list[str]], list[str]]:
    """A file store with three chains; with ``damaged``, two bad pages. (chains, bad keys)"""

    async def run() -> tuple[list[list[str]], list[str]]:
        backend = await FileBackend.open(FileConfig(root=str(root)))
        kit = StoreKit(backend, root)
        chains = [await kit.chain(4, tenant=f"t{i}") for i in range(3)]
        bad: list[str] = []
        if damaged:
            await kit.flip_bit(chains[0][2], HEADER_SIZE + 1)
            await kit.truncate(chains[1][3], 50)
            bad = [chains[0][2], chains[1][3]]
        await backend.close()
        return chains, bad

    return asyncio.run(run())


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_and_verify_name_objects_the_same_way(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chains, bad = build(tmp_path / "s")
    url = f"file://{tmp_path / 's'}"
    code, out, _ = run_cli(capsys, "inspect", url, "--list", "--format", "json")
    assert code == 0
    listed = {row["key"] for row in json.loads(out)}
    assert listed == {k for chain in chains for k in chain}
    code, out, _ = run_cli(capsys, "verify", url, "--json", "--quiet")
    report = json.loads(out)
    assert code == 1 and report["objects"] == 12
    assert sorted(row["key"] for row in report["bad"]) == sorted(bad) and set(bad) <= listed
    code, out, _ = run_cli(capsys, "verify", url, "--delete-bad")
    assert code == 1 and out.splitlines()[-1] == "deleted 2"
    code, out, _ = run_cli(capsys, "verify", url)
    assert code == 0 and out.startswith("10 objects, ") and out.rstrip().endswith(": 0 bad")


def test_inspect_outputs(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    build(tmp_path / "s", damaged=False)
    url = f"file://{tmp_path / 's'}"
    code, out, _ = run_cli(capsys, "inspect", url)
    assert code == 0 and out.startswith("objects      12")
    code, out, _ = run_cli(capsys, "inspect", url, "--format", "json")
    assert json.loads(out)["objects"] == 12
    target = tmp_path / "cat.parquet"
    code, out, _ = run_cli(capsys, "inspect", url, "--format", "parquet", "--output", str(target))
    assert code == 0 and target.stat().st_size > 0
    code, _, err = run_cli(capsys, "inspect", url, "--format", "parquet")
    assert code == 2 and "--output" in err


def test_compact_plan_then_run(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    chains, bad = build(tmp_path / "s")
    url = f"file://{tmp_path / 's'}"
    code, out, _ = run_cli(capsys, "compact", url, "--dry-run", "--json", "--grace", "0")
    plan = json.loads(out)
    expected = {bad[0]: "corrupt", bad[1]: "truncated", chains[0][3]: "orphan"}
    assert code == 0 and plan["dry_run"] is True
    assert {r["key"]: r["reason"] for r in plan["removed"]} == expected
    code, out, _ = run_cli(capsys, "compact", url, "--json", "--grace", "0", "--max-bytes", "1")
    report = json.loads(out)
    assert code == 0 and report["dry_run"] is False
    assert report["bytes_reclaimed"] == report["bytes"]  # the whole store, over budget
    code, out, _ = run_cli(capsys, "inspect", url, "--format", "json")
    assert json.loads(out)["objects"] == 0


def test_stats(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    build(tmp_path / "s", damaged=False)
    url = f"file://{tmp_path / 's'}"
    code, out, _ = run_cli(capsys, "stats", url, "--watch", "0.01", "--count", "2", "--json")
    reports = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(reports) == 2 and reports[0]["stats"]["objects"] == 12


def test_bad_input_exits_2_and_changes_nothing(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    for argv in (
        ["inspect", "nosuch://x"],
        ["verify", f"file://{missing}"],
        ["stats", "memory://"],
        ["compact", "not a url"],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and err.startswith("hicache: error:"), argv
    assert not missing.exists()
    (tmp_path / "plain").write_text("a file, not a directory")
    code, _, err = run_cli(capsys, "inspect", f"file://{tmp_path / 'plain'}")
    assert code == 2 and "no store" in err
    # A directory of other files that happen to have valid names: not a hicache store.
    other = tmp_path / "other"

    async def fill() -> None:
        backend = await FileBackend.open(FileConfig(root=str(other)))
        await backend.put([f"doc-{i}" for i in range(5)], [os.urandom(200)] * 5)
        await backend.close()

    asyncio.run(fill())
    stale = StoreKit(None, other).temp_file("doc-1", age_s=3600)  # type: ignore[arg-type]
    before = sorted(p.name for p in other.rglob("*"))
    for command in ("inspect", "verify", "compact"):
        extra = ["--delete-bad"] if command == "verify" else []
        code, _, err = run_cli(capsys, command, f"file://{other}", *extra)
        assert code == 2 and "not a hicache store" in err, command
    assert sorted(p.name for p in other.rglob("*")) == before and stale.exists()


@pytest.mark.slow
def test_bench_tools_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "tools", "--small-objects", "64", "--large-objects", "3"]
    code, out, _ = run_cli(capsys, *argv, "--large-bytes", "64K", "--repeats", "1", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["workload"] for r in rows] == ["small", "large"]
    for row in rows:
        assert row["verify_ratio"] > 0 and row["raw_read_objects_per_s"] > 0
        # GB/s is rounded to 3 places: 256 KiB of small objects on a loaded machine can show 0.0.
        assert row["inspect_objects_per_s"] > 0 and row["verify_gbps"] >= 0


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_only_on_a_terminal() -> None:
    quiet = io.StringIO()
    with Progress("verify", stream=quiet) as bar:
        bar.advance(10, 1 << 20)
    assert quiet.getvalue() == ""
    tty = _Tty()
    with Progress("verify", total=20, stream=tty) as bar:
        bar.advance(10, 1 << 20)
    text = tty.getvalue()
    assert text.startswith("\rverify: [") and "10/20" in text and text.endswith("\n")
    off = _Tty()
    with Progress("verify", stream=off, enabled=False) as bar:
        bar.advance(5)
    assert off.getvalue() == ""
