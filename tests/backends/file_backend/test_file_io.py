"""The file backend's reads and writes: pieces, short reads, cancellation, O_DIRECT, and
several processes on one directory."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import mmap
import multiprocessing
import os
import pathlib
import threading
from typing import Any

import pytest
from file_kit import (
    open_file,
    opened_store,
    read,
)

from hicache.backends.base import MISS
from hicache.backends.file import FileBackend, reads

store = pytest.fixture(opened_store, name="store")


# ----- reads and writes in pieces -------------------------------------------------------------
async def test_partial_writes_and_short_reads_are_completed(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev, real_preadv = os.writev, os.preadv
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real_writev(fd, [bufs[0][:1000]]))
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real_preadv(fd, [bufs[0][:777]], off))
    parts = [os.urandom(2500), b"", os.urandom(3001)]
    assert await store.put(["k"], [parts]) == [True]
    head, tail = bytearray(4000), bytearray(2000)
    assert await store.get_into(["k"], [[head, tail]]) == [5501]
    assert bytes(head) + bytes(tail[:1501]) == b"".join(parts)


async def test_object_shorter_than_its_size_is_a_miss(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await store.put(["k"], [b"data" * 100]) == [True]
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0)  # end of file came early
    assert await store.get_into(["k"], [bytearray(400)]) == [MISS]
    assert (await store.stats())["short_reads"] == 1


async def test_small_buffer_gets_size_without_a_read(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await store.put(["k"], [b"q" * 1000]) == [True]

    def no_read(*_: object) -> int:
        raise AssertionError("nothing should be read into a buffer that is too small")

    monkeypatch.setattr(os, "preadv", no_read)
    buf = bytearray(10)
    assert await store.get_into(["k"], [buf]) == [1000] and buf == bytearray(10)


async def test_cancelled_put_returns_only_after_its_writes(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    writing, release = threading.Event(), threading.Event()
    finished: list[int] = []
    real_writev = os.writev

    def slow_writev(fd: int, buffers: list[memoryview]) -> int:
        writing.set()
        release.wait(10)
        n = real_writev(fd, buffers)
        finished.append(n)
        return n

    monkeypatch.setattr(os, "writev", slow_writev)
    value = bytearray(b"v" * 1000)
    task = asyncio.ensure_future(store.put(["k"], [value]))
    assert await asyncio.to_thread(writing.wait, 10)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()  # still waiting for the thread that reads `value`
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [1000]  # the caller may reuse `value` now: no thread reads it any more


async def test_batches_split_across_threads_keep_order(tmp_path: pathlib.Path) -> None:
    backend = await open_file(tmp_path, io_threads=3, thread_min_bytes=1)
    keys = [f"k{i}" for i in range(10)]
    values = [bytes([i]) * (100 + i) for i in range(10)]
    assert await backend.put(keys, values) == [True] * 10
    buffers = [bytearray(200) for _ in keys]
    assert await backend.get_into(keys, buffers) == [len(v) for v in values]
    assert [bytes(b[: len(v)]) for b, v in zip(buffers, values, strict=True)] == values
    assert await backend.delete([*keys[:5], "absent"]) == [True] * 5 + [False]
    assert await backend.exists(keys) == [False] * 5 + [True] * 5
    await backend.close()


async def test_fsync_option(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    plain = await open_file(tmp_path / "plain")
    assert await plain.put(["k"], [b"v"]) == [True] and synced == []
    durable = await open_file(tmp_path / "durable", fsync=True)
    assert await durable.put(["k"], [b"v"]) == [True]
    assert len(synced) >= 2  # the file before its rename, its directory after
    assert await read(durable, "k", 1) == b"v"


# ----- O_DIRECT -------------------------------------------------------------------------------
async def o_direct_store_with_k(root: pathlib.Path, nbytes: int) -> tuple[FileBackend, bytes]:
    """An O_DIRECT store at ``root`` holding one object, ``k``: ``nbytes`` random bytes."""
    backend = await open_file(root, o_direct=True)
    payload = os.urandom(nbytes)
    assert await backend.put(["k"], [payload]) == [True]
    return backend, payload


async def test_o_direct_reads_are_correct(tmp_path: pathlib.Path) -> None:
    backend = await open_file(tmp_path, o_direct=True)
    small, whole = os.urandom(5000), os.urandom(8192)
    assert await backend.put(["small", "whole"], [small, whole]) == [True, True]
    aligned = [mmap.mmap(-1, 8192), mmap.mmap(-1, 8192)]  # anonymous maps are page-aligned
    assert await backend.get_into(["small", "whole"], aligned) == [5000, 8192]
    assert aligned[0][:5000] == small and aligned[1][:] == whole
    odd = bytearray(5001)  # not a multiple of 4096: always buffered
    assert await backend.get_into(["small"], [odd]) == [5000] and odd[:5000] == small
    stats = await backend.stats()
    assert stats["o_direct_reads"] + stats["o_direct_fallbacks"] == 3
    assert stats["o_direct_fallbacks"] >= 1
    if stats["o_direct_reads"] == 0:  # only when this filesystem refused O_DIRECT
        assert backend._o_direct is False
    await backend.close()


async def test_o_direct_refused_falls_back_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, payload = await o_direct_store_with_k(tmp_path, 4096)
    real_open, direct_opens = reads.open_key, []

    def no_direct(root: str, fan: str, key: str, flags: int) -> int:
        if flags & os.O_DIRECT:
            direct_opens.append(key)
            raise OSError(errno.EINVAL, "Invalid argument", key)  # what tmpfs said before 6.6
        return real_open(root, fan, key, flags)

    monkeypatch.setattr(reads, "open_key", no_direct)
    for _ in range(2):
        buf = mmap.mmap(-1, 4096)
        assert await backend.get_into(["k"], [buf]) == [4096] and buf[:] == payload
    stats = await backend.stats()
    assert stats["o_direct_fallbacks"] == 2 and stats["o_direct_reads"] == 0
    assert len(direct_opens) == 1  # refused once, then not tried again
    await backend.close()


async def test_o_direct_read_refused_after_open_falls_back(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, payload = await o_direct_store_with_k(tmp_path, 6000)
    real_preadv = os.preadv

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct)
    buf = mmap.mmap(-1, 8192)
    assert await backend.get_into(["k"], [buf]) == [6000] and buf[:6000] == payload
    stats = await backend.stats()
    assert stats["o_direct_fallbacks"] == 1 and stats["read_errors"] == 0
    assert backend._o_direct is False
    await backend.close()


# ----- several processes on one directory ---------------------------------------------------
OBJECT = 256 << 10
KEYS = ["shared-0", "shared-1", "shared-2"]


def overwrite_in_loop(root: str, rounds: int, started: Any) -> None:
    """Child process: rewrite every key with a whole-object pattern, again and again."""

    async def main() -> None:
        backend = await open_file(pathlib.Path(root))
        for r in range(rounds):
            fill = bytes([r % 255 + 1]) * OBJECT
            assert await backend.put(KEYS, [fill] * len(KEYS)) == [True] * len(KEYS)
            started.set()
        await backend.close()

    asyncio.run(main())


async def test_other_process_overwrites_are_never_torn(tmp_path: pathlib.Path) -> None:
    backend = await open_file(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    writer = ctx.Process(target=overwrite_in_loop, args=(str(tmp_path), 150, started))
    writer.start()
    buffers = [bytearray(OBJECT) for _ in KEYS]

    async def read_all() -> int:
        hits = 0
        for n, buf in zip(await backend.get_into(KEYS, buffers), buffers, strict=True):
            if n >= 0:
                assert n == OBJECT and buf[0] != 0
                assert buf.count(buf[0]) == OBJECT  # one writer's whole pattern, never a mix
                hits += 1
        return hits

    try:
        assert await asyncio.to_thread(started.wait, 60)
        hits = 0
        while writer.is_alive():
            hits += await read_all()
    finally:
        await asyncio.to_thread(writer.join, 60)
    assert writer.exitcode == 0
    assert await read_all() == len(KEYS) and buffers[0][0] == 150  # the last round's pattern
    await backend.close()
    if hits == 0:  # a very slow reader; the final read above still checked the objects
        pytest.skip("the writer finished before any read ran alongside it")


@pytest.mark.parametrize(("min_bytes", "threads"), [(None, 1), (1, 3), (250, 2)])
async def test_batches_split_by_bytes(
    tmp_path: pathlib.Path, min_bytes: int | None, threads: int
) -> None:
    """A thread per chunk only where each chunk has ``thread_min_bytes``: small pages go in one
    thread (default 4 MiB), a batch of 600 bytes with 250 per thread in two."""
    options = {} if min_bytes is None else {"thread_min_bytes": min_bytes}
    backend = await open_file(tmp_path, io_threads=3, **options)
    seen: set[int] = set()
    put_one = backend._put_one
    together = threading.Barrier(threads)  # each chunk's thread waits for the others once

    def spy(key: str, segs: list[memoryview]) -> bool:
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            together.wait(timeout=10)
        return put_one(key, segs)

    backend._put_one = spy  # type: ignore[method-assign]
    keys = [f"k{i}" for i in range(6)]
    assert await backend.put(keys, [bytes([i]) * 100 for i in range(6)]) == [True] * 6
    assert len(seen) == threads
    assert await backend.exists(keys) == [True] * 6
    await backend.close()
