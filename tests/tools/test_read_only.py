"""The store tools that only read (``verify``, ``inspect``, ``stats``) open a store read-only
and never write to it, so they work on a read-only mount or a snapshot.

How "read-only" is made here: see :class:`store_kit.WriteGuard` (tests run as root, which
ignores permission bits, so every writing system call fails with ``EROFS`` instead, as on a
read-only mount). Each test also compares the store's whole tree, mtimes included, before and
after.
"""

from __future__ import annotations

import asyncio
import io
import pathlib

import pytest
from cli_kit import run
from store_kit import StoreKit, WriteGuard, snapshot

from hicache.backends.file import FileBackend, FileConfig
from hicache.errors import BackendUnavailableError, ReadOnlyStoreError
from hicache.tools.store.compact import CompactOptions, compact_store
from hicache.tools.store.inspect import InspectOptions, inspect_store
from hicache.tools.store.scan import open_store
from hicache.tools.store.stats import StatsOptions, watch_stats
from hicache.tools.store.verify import VerifyOptions, verify_store


async def _filled(root: pathlib.Path) -> list[list[str]]:
    backend = await FileBackend.open(FileConfig(root=str(root)))
    kit = StoreKit(backend, root)
    chains = [await kit.chain(4) for _ in range(3)]
    kit.temp_file(chains[0][0], age_s=3600)  # a crashed writer's: only compact removes it
    await backend.close()
    return chains


async def test_reading_tools_on_a_read_only_store(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    chains = await _filled(root)
    before = snapshot(root)
    guard = WriteGuard(monkeypatch, root)
    store = await open_store(f"file://{root}", read_only=True)
    try:
        report = await verify_store(store, VerifyOptions(processes=1))
        assert (report.objects, report.bad) == (12, [])
        summary = await inspect_store(store, InspectOptions(), io.StringIO())
        assert summary.total.objects == 12
        out = io.StringIO()
        await watch_stats(store, StatsOptions(), out)
        assert dict(line.split() for line in out.getvalue().splitlines() if line)["objects"] == "12"
        with pytest.raises(ReadOnlyStoreError, match="read-only"):
            await store.put(["k"], [b"x"])
        with pytest.raises(ReadOnlyStoreError):
            await compact_store(store, CompactOptions(max_bytes=1))
        assert await store.exists([chains[1][0]]) == [True]
    finally:
        await store.close()
    assert guard.attempts == []
    assert snapshot(root) == before


async def test_a_writable_open_of_a_read_only_store_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``compact`` gets there: a clear error at open, not a failure halfway."""
    root = tmp_path / "store"
    await _filled(root)
    WriteGuard(monkeypatch, root)
    with pytest.raises(BackendUnavailableError, match="Read-only file system"):
        await open_store(f"file://{root}")


async def test_the_url_may_ask_for_read_only(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "store"
    await _filled(root)
    store = await open_store(f"file://{root}?read_only=true")
    try:
        with pytest.raises(ReadOnlyStoreError):
            await store.delete(["k"])
    finally:
        await store.close()
    assert not (tmp_path / "absent").exists()
    with pytest.raises(BackendUnavailableError, match="no store"):
        await open_store(f"file://{tmp_path / 'absent'}", read_only=True)
    assert not (tmp_path / "absent").exists()


def test_the_commands_that_only_read_work_on_a_read_only_store(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hicache inspect|verify|stats``, then ``verify --delete-bad``, which must write."""
    root = tmp_path / "store"
    asyncio.run(_filled(root))
    before = snapshot(root)
    guard = WriteGuard(monkeypatch, root)
    url = f"file://{root}"
    for argv in (["inspect", url, "-q"], ["verify", url, "-q", "--processes", "1"], ["stats", url]):
        code, out, err = run(capsys, *argv)
        assert (code, err) == (0, "") and "12" in out, argv
    assert guard.attempts == []
    code, out, err = run(capsys, "verify", url, "-q", "--processes", "1", "--delete-bad")
    assert (code, out) == (1, "") and err.count("\n") == 1, err
    assert err.startswith("hicache: error: ") and "Read-only file system" in err
    assert snapshot(root) == before
