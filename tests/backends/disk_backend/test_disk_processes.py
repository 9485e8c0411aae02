"""The disk backend with several processes on one directory: a put that returned in one is
found by the next call of another, deletes reach the others within ``REFRESH_S``, writers
hold distinct slots, a reopen sees the union, a read-only open sees all and writes nothing.

Children are started with multiprocessing's spawn and driven through queues.

The first look at a store after a writer left (closed, killed) finds what it stored: a
reader opened before that writer, one that keeps running while writers come and go, one
that opens while a writer closes (its closing snapshot removes the log generations it
covers, which a reader that never read them must find through the snapshot).
"""

from __future__ import annotations

import asyncio
import errno
import pathlib
import queue
import time
from typing import Any

import pytest
from disk_kit import CTX, KIB, MIB, Child, open_disk, value_of

from hicache.backends.disk import catalog
from hicache.backends.disk.catalog import REFRESH_S
from hicache.errors import ReadOnlyStoreError

SLACK_S = 0.3  # scheduling noise on a loaded machine, on top of REFRESH_S


@pytest.mark.asyncio
async def test_puts_found_and_deletes_missed_across_processes(tmp_path: pathlib.Path) -> None:
    """A child's acknowledged put is found by the parent's very next exists or get_into (a
    miss reads the logs), and the parent's by the child's; a child's delete is a miss in the
    parent within REFRESH_S, even while the parent keeps finding the key in its index."""
    parent = await open_disk(tmp_path, segment_bytes=MIB)
    child = await asyncio.to_thread(Child, tmp_path)
    assert parent._appender is not None and child.slot != parent._appender.slot
    try:
        for i in range(1, 13):
            key = f"from-child-{i}"
            assert await asyncio.to_thread(child.call, "put", key, i) == [True]
            if i % 2:
                assert await parent.exists([key]) == [True]
            buf = bytearray(32 * KIB)
            (n,) = await parent.get_into([key], [buf])
            assert bytes(buf[:n]) == value_of(key, i)
            mine = f"from-parent-{i}"
            assert await parent.put([mine], [value_of(mine, i)]) == [True]
            if i % 2 == 0:
                assert await asyncio.to_thread(child.call, "exists", mine) == [True]
            assert await asyncio.to_thread(child.call, "get", mine) == value_of(mine, i)
        for i in (1, 2, 3):
            key = f"from-child-{i}" if i % 2 else f"from-parent-{i}"
            assert await parent.exists([key]) == [True]  # the parent's index holds it now
            assert await asyncio.to_thread(child.call, "delete", key) == [True]
            gone = time.monotonic()
            while await parent.exists([key]) == [True]:
                assert time.monotonic() - gone < REFRESH_S + SLACK_S, f"{key} still found"
                await asyncio.sleep(0.01)
            assert await parent.get([key]) == [None]
    finally:
        await asyncio.to_thread(child.end)
        await parent.close()


@pytest.mark.asyncio
async def test_delete_of_another_slots_put_stays_deleted(tmp_path: pathlib.Path) -> None:
    """Slot 0 deletes what slot 1 put, and both die without a snapshot: a reader that reads
    both records in one refresh, and a reopen that replays the logs slot by slot (the DELETE
    first), both find a miss; the older PUT must not bring the key back."""
    deleter = await asyncio.to_thread(Child, tmp_path)  # first: slot 0
    putter = await asyncio.to_thread(Child, tmp_path)
    assert (deleter.slot, putter.slot) == (0, 1)
    reader = await open_disk(tmp_path, read_only=True)
    assert await reader.exists(["doomed"]) == [False]  # read the logs once, before both
    assert await asyncio.to_thread(putter.call, "put", "doomed", 5) == [True]
    assert await asyncio.to_thread(putter.call, "put", "kept", 6) == [True]
    assert await asyncio.to_thread(deleter.call, "delete", "doomed") == [True]
    await asyncio.to_thread(putter.end, "crash")
    await asyncio.to_thread(deleter.end, "crash")
    assert not (tmp_path / "index" / "snapshot").exists()
    assert await reader.exists(["doomed", "kept"]) == [False, True]
    await reader.close()
    for read_only in (True, False):
        backend = await open_disk(tmp_path, read_only=read_only)
        assert await backend.get(["doomed", "kept"]) == [None, value_of("kept", 6)]
        await backend.close()


@pytest.mark.asyncio
async def test_reader_waiting_for_a_generation_removed_before_it_looked(
    tmp_path: pathlib.Path,
) -> None:
    """A reader read a ROTATE whose generation was not created yet (the writer's disk was
    full); the writer then created it, filled it and snapshotted it away before the reader
    looked again. The reader rebuilds from the snapshot: nothing is lost to it."""
    writer = await open_disk(tmp_path, segment_bytes=MIB, snapshot_records=4)
    reader = await open_disk(tmp_path, read_only=True)
    assert writer._appender is not None
    log = writer._appender.log
    create = log._create
    failures = [OSError(errno.ENOSPC, "No space left on device")]

    def create_once_full(generation: int) -> None:
        if failures:
            raise failures.pop()
        create(generation)

    log._create = create_once_full  # type: ignore[method-assign]
    first = [f"a{i}" for i in range(4)]
    assert await writer.put(first, [b"x"] * 4) == [True] * 4  # its snapshot's rotate failed
    assert await reader.exists(first) == [True] * 4  # read up to the ROTATE
    second = [f"b{i}" for i in range(8)]
    for key in second:  # the generation is created, filled, snapshotted, removed
        assert await writer.put([key], [key.encode()]) == [True]
    assert await reader.get(second) == [k.encode() for k in second]
    assert (await reader.stats())["log_gaps"] == 0
    await reader.close()
    await writer.close()


# ----- writers that leave before a reader looks ---------------------------------------------------
async def found_by(reader: Any, pages: list[str]) -> None:
    """``pages`` (version 1 each) are found by the reader's next exists, and read exact."""
    assert await reader.exists(pages) == [True] * len(pages)
    assert await reader.get(pages, size_hint=32 * KIB) == [value_of(k, 1) for k in pages]
    assert (await reader.stats())["log_gaps"] == 0


@pytest.mark.parametrize("end", ["close", "kill"])
@pytest.mark.parametrize("reader_kind", ["writer", "read_only"])
@pytest.mark.asyncio
async def test_pages_of_a_writer_that_left_before_the_reader_looked(
    tmp_path: pathlib.Path, reader_kind: str, end: str
) -> None:
    """A reader opened before the writer started; the writer stores 96 pages (a snapshot
    comes due after 64) and closes, or is killed with SIGKILL, before the reader looks: the
    reader's next call finds all 96. (Its snapshots removed the log generations the reader
    never read; the reader started on the slot at the oldest one left.)"""
    holder = await open_disk(tmp_path, segment_bytes=MIB)  # slot 0: the writer takes a new one
    reader = holder if reader_kind == "writer" else await open_disk(tmp_path, read_only=True)
    try:
        writer = await asyncio.to_thread(Child, tmp_path)
        assert writer.slot == 1
        pages = await asyncio.to_thread(writer.call, "fill", "w", 96)
        await asyncio.to_thread(writer.kill if end == "kill" else writer.end)
        await found_by(reader, pages)
    finally:
        if reader is not holder:
            await reader.close()
        await holder.close()


@pytest.mark.asyncio
async def test_writers_come_and_go_while_readers_run(tmp_path: pathlib.Path) -> None:
    """Four writers in turn in one slot, each opened, filled and closed (the third killed)
    while two readers stay open: one looks after each writer left (and while the second
    and fourth still run), the other only once all are gone. Both find every page."""
    looker = await open_disk(tmp_path, segment_bytes=MIB)  # holds slot 0 throughout
    late = await open_disk(tmp_path, read_only=True)
    pages: list[str] = []
    try:
        for turn in range(4):
            writer = await asyncio.to_thread(Child, tmp_path)
            assert writer.slot == 1
            mine = await asyncio.to_thread(writer.call, "fill", f"t{turn}", 40 + 30 * turn)
            if turn % 2:
                assert await looker.exists(mine) == [True] * len(mine)
            await asyncio.to_thread(writer.kill if turn == 2 else writer.end)
            pages += mine
            assert await looker.exists(pages) == [True] * len(pages), f"after writer {turn}"
        await found_by(looker, pages)
        await found_by(late, pages)
    finally:
        await late.close()
        await looker.close()


@pytest.mark.parametrize("covered", [False, True])
@pytest.mark.asyncio
async def test_reader_opening_while_a_writer_closes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, covered: bool
) -> None:
    """A reader opens while a writer closes: the reader has read the snapshot (none yet, or
    one that covers the writer's slot only in part) when the writer's closing snapshot
    replaces it and removes the log generations it covers, before the reader lists them.
    The writer process closes at exactly that point of the open; the open finds every page."""
    holder = await open_disk(tmp_path, segment_bytes=MIB)  # slot 0: the writer takes a new one
    writer = await asyncio.to_thread(Child, tmp_path)
    pages = await asyncio.to_thread(writer.call, "fill", "w", 80 if covered else 40)
    assert (tmp_path / "index" / "snapshot").exists() == covered
    list_generations = catalog.list_generations

    def close_writer_first(index_fd: int) -> dict[int, list[int]]:
        if writer.process.is_alive():  # the first listing of the open: the snapshot is read
            writer.end()
        return list_generations(index_fd)

    monkeypatch.setattr(catalog, "list_generations", close_writer_first)
    reader = await open_disk(tmp_path, read_only=True)
    monkeypatch.undo()
    try:
        assert not writer.process.is_alive()
        await found_by(reader, pages)
    finally:
        await reader.close()
        await holder.close()


# ----- the hammer ----------------------------------------------------------------------------
WORKERS = 3
STEPS = 40


def hammer(root: str, me: int, inboxes: list[Any], together: Any, results: Any) -> None:
    """Child: once all are open, put own pages and tell the others; check the pages the others
    told of with the very next call; overwrite shared keys; put and delete scratch keys. At the
    end, once all are done, check what is left in the inbox."""

    async def main() -> None:
        backend = await open_disk(pathlib.Path(root))
        assert backend._appender is not None
        await asyncio.to_thread(together.wait, 30)  # all hold their slots now
        own: list[str] = []
        checked = 0
        for step in range(STEPS):
            keys = [f"p{me}-{step}-{j}" for j in range(3)]
            assert await backend.put(keys, [value_of(k, 1) for k in keys]) == [True] * 3
            own += keys
            for other, inbox in enumerate(inboxes):
                if other != me:
                    inbox.put(keys)
            checked += await check_told(backend, inboxes[me], exists_first=step % 2 == 1)
            await write_and_read_shared(backend, me, step)
            scratch = f"tmp{me}-{step}"
            assert await backend.put([scratch], [b"scratch"]) == [True]
            assert await backend.delete([scratch]) == [True]
        await asyncio.to_thread(together.wait, 30)  # everybody's puts have returned
        # A queue's messages travel through a feeder thread: the last ones may still be on
        # their way after the barrier, so wait for as many as the others sent.
        rest = (WORKERS - 1) * STEPS * 3 - checked
        checked += await check_told(backend, inboxes[me], exists_first=True, at_least=rest)
        results.put((me, backend._appender.slot, own, checked))
        await backend.close()

    asyncio.run(main())


async def check_told(backend: Any, inbox: Any, exists_first: bool, at_least: int = 0) -> int:
    """The pages the inbox told of are found by the next call (exists or a read), exact;
    with ``at_least``, the inbox is waited on until that many pages came."""
    told: list[str] = []
    while True:
        try:
            told += inbox.get_nowait()
        except queue.Empty:
            if len(told) >= at_least:
                break
            told += await asyncio.to_thread(inbox.get, timeout=30)
    if told and exists_first:
        assert await backend.exists(told) == [True] * len(told), told
    if told:
        assert await backend.get(told, size_hint=32 * KIB) == [value_of(k, 1) for k in told]
    return len(told)


async def write_and_read_shared(backend: Any, me: int, step: int) -> None:
    """Overwrite one of five shared keys; each shared key reads as some writer's whole value."""
    version = me * 10**6 + step * 17 + 1  # never a multiple of 17: never the empty value
    key = f"shared-{step % 5}"
    assert await backend.put([key], [value_of(key, version)]) == [True]
    names = [f"shared-{i}" for i in range(5)]
    for name, data in zip(names, await backend.get(names, size_hint=32 * KIB), strict=True):
        if data is not None:
            stated = int(data.split(b"#")[1])  # the version the value says it is
            assert data == value_of(name, stated), name


@pytest.mark.asyncio
async def test_three_writers_and_a_reader_hammer_one_store(tmp_path: pathlib.Path) -> None:
    """Three writer processes and a read-only parent at once: every page one of them stored is
    found byte-exact by the others' next calls, slots are distinct, the read-only open refuses
    writes, and a reopen after all exit holds exactly the union (scratch keys deleted)."""
    parent = await open_disk(tmp_path, segment_bytes=MIB)  # creates the store,
    await parent.close()  # then leaves: the children take slots 0 to 2
    reader = await open_disk(tmp_path, read_only=True)
    inboxes = [CTX.Queue() for _ in range(WORKERS + 1)]  # the last one is the parent's
    results, together = CTX.Queue(), CTX.Barrier(WORKERS)
    workers = [
        CTX.Process(target=hammer, args=(str(tmp_path), i, inboxes, together, results), daemon=True)
        for i in range(WORKERS)
    ]
    for worker in workers:
        worker.start()
    seen = 0
    while any(w.is_alive() for w in workers) or not inboxes[-1].empty():
        try:
            told = await asyncio.to_thread(inboxes[-1].get, timeout=0.2)
        except queue.Empty:
            continue
        assert await reader.exists(told) == [True] * len(told)
        assert await reader.get(told, size_hint=32 * KIB) == [value_of(k, 1) for k in told]
        seen += len(told)
    with pytest.raises(ReadOnlyStoreError):
        await reader.put(["nope"], [b"x"])
    with pytest.raises(ReadOnlyStoreError):
        await reader.delete(["shared-0"])
    await reader.close()
    for worker in workers:
        worker.join(30)
        assert worker.exitcode == 0
    reports = [results.get(timeout=5) for _ in workers]
    assert sorted(slot for _, slot, _, _ in reports) == [0, 1, 2]
    # Each checked every page the two others stored.
    assert [checked for *_, checked in reports] == [2 * STEPS * 3] * WORKERS
    union = sorted(key for _, _, own, _ in reports for key in own)
    assert seen == len(union) == WORKERS * STEPS * 3
    backend = await open_disk(tmp_path)
    assert sorted([i.key async for i in backend.scan("p")]) == union
    assert await backend.get(union, size_hint=32 * KIB) == [value_of(k, 1) for k in union]
    assert [i.key async for i in backend.scan("tmp")] == []
    await write_and_read_shared(backend, 9, 0)
    await backend.close()
