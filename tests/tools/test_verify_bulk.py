"""The fast path of ``verify`` (the file backend's ``read_all``) against the generic one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import struct

import pytest
import xxhash
from store_kit import StoreKit
from test_verify import damage

from hicache.backends.file import FileBackend
from hicache.backends.file.io import ReadBuffer
from hicache.backends.file.maintenance import BulkReader
from hicache.backends.file.scan import top_dirs
from hicache.backends.memory import MemoryBackend
from hicache.codec import HEADER_SIZE, check_page, verify_page
from hicache.errors import BadMagicError, CodecError
from hicache.tools.store.verify import VerifyOptions, verify_store


def _rows(report_bad: list) -> list[tuple[str, str, str]]:  # type: ignore[type-arg]
    return sorted((b.key, b.problem.value, b.detail) for b in report_bad)


async def test_only_the_file_backend_reads_in_bulk(file_kit: StoreKit) -> None:
    assert isinstance(file_kit.backend, BulkReader)
    assert not isinstance(MemoryBackend(), BulkReader)


@pytest.mark.parametrize("parallel", [1, 3])
async def test_fast_and_generic_paths_report_the_same(file_kit: StoreKit, parallel: int) -> None:
    chains, bad = await damage(file_kit)
    big = await file_kit.chain(3, payload_bytes=(1 << 20) + 5)  # larger than a fresh buffer
    await file_kit.flip_bit(big[1], HEADER_SIZE + (1 << 20))
    fast = await verify_store(file_kit.backend, VerifyOptions(parallel=parallel))
    slow = await verify_store(file_kit.backend, VerifyOptions(parallel=parallel, bulk=False))
    assert (fast.objects, fast.bytes) == (slow.objects, slow.bytes)
    assert fast.objects == sum(map(len, chains)) + 1 + 3
    assert _rows(fast.bad) == _rows(slow.bad)
    assert {b.key: b.problem for b in fast.bad} == {**bad, big[1]: bad[chains[0][1]]}


async def test_fast_path_honours_the_prefix_and_skips_foreign_files(file_kit: StoreKit) -> None:
    chain = await file_kit.chain(2)
    for key in ("aa-one", "aa-two", "bb-three"):
        await file_kit.replace(key, b"x" * 300)
    file_kit.temp_file("aa-four", age_s=0)  # a write in progress
    stray = file_kit.path("aa-one").parent / "aa-stray"  # in a directory its hash does not name
    stray.write_bytes(b"y" * 10)
    backend = file_kit.backend
    assert isinstance(backend, FileBackend)

    async def read(prefix: str) -> list[tuple[str, bytes]]:
        got: list[tuple[str, bytes]] = []
        async for batch in backend.read_all(prefix, lambda k, v: (k, bytes(v)), threads=2):
            got.extend(batch)
        return sorted(got)

    assert await read("aa-") == [("aa-one", b"x" * 300), ("aa-two", b"x" * 300)]
    everything = await read("")
    assert len(everything) == 5 and all(not k.startswith(".") for k, _ in everything)
    report = await verify_store(backend, VerifyOptions(prefix=chain[0][:17]))
    assert (report.objects, report.bad) == (2, [])
    for bulk in (True, False):  # no page among the objects the prefix selects: not a store
        with pytest.raises(BadMagicError, match="none of the first 2 objects"):
            await verify_store(backend, VerifyOptions(prefix="aa-", bulk=bulk))


async def test_closing_early_waits_for_the_reads(file_kit: StoreKit) -> None:
    for _ in range(20):
        await file_kit.chain(8)
    backend = file_kit.backend
    assert isinstance(backend, FileBackend)
    reads = backend.read_all("", lambda k, v: v.nbytes, threads=3)
    async with contextlib.aclosing(reads) as batches:
        first = await anext(batches)
    assert first and all(n > HEADER_SIZE for n in first)
    report = await verify_store(backend, VerifyOptions())  # the backend is still usable
    assert (report.objects, report.bad) == (160, [])


@pytest.mark.parametrize("size", [0, 100, 4096, 4097, (3 << 20) + 1])
def test_read_buffer_reads_whole_files(tmp_path: pathlib.Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    buf = ReadBuffer(4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert buf.read_whole(fd).tobytes() == data
        assert buf.read_whole(fd).tobytes() == data  # again, into the grown buffer
    finally:
        os.close(fd)


def _outcome(fn: object, key: str, data: bytes) -> str:
    try:
        fn(key, data)  # type: ignore[operator]
    except CodecError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def test_verify_page_agrees_with_check_page_on_every_header_byte(
    memory_kit: StoreKit,
) -> None:
    (key,) = await memory_kit.chain(1, payload_bytes=64)
    (compressed,) = await memory_kit.chain(1, compress=True, payload_bytes=256)
    for name in (key, compressed):
        page = await memory_kit.read(name)
        assert _outcome(verify_page, name, page) == _outcome(check_page, name, page) == "ok"
        outcomes = set()
        for offset in range(HEADER_SIZE + 1):
            damaged = bytearray(page)
            damaged[offset] ^= 0x41
            resealed = bytearray(damaged)  # the header checksum made right again: field checks
            struct.pack_into("<Q", resealed, 152, xxhash.xxh3_64_intdigest(bytes(resealed[:152])))
            cut = bytes(damaged[: HEADER_SIZE + offset // 2])
            for data in (bytes(damaged), bytes(resealed), cut):
                want = _outcome(check_page, name, data)
                assert _outcome(verify_page, name, data) == want, offset
                outcomes.add(want.split(":")[0])
        assert len(outcomes) >= 6  # several kinds of damage were seen, not one error throughout


async def test_worker_processes_report_the_same_as_one_thread(file_kit: StoreKit) -> None:
    chains, bad = await damage(file_kit)
    for _ in range(30):  # enough objects to spread over the many top-level directories needed
        chains.append(await file_kit.chain(8))
    backend = file_kit.backend
    assert isinstance(backend, FileBackend)
    tops = len(await asyncio.to_thread(top_dirs, backend.config.root))
    assert tops > 1 + 16 * 2  # so the process path is taken, not the thread path
    spawned = await verify_store(backend, VerifyOptions(processes=2))
    threaded = await verify_store(backend, VerifyOptions(processes=1))
    generic = await verify_store(backend, VerifyOptions(bulk=False))
    assert spawned.objects == threaded.objects == generic.objects == sum(map(len, chains)) + 1
    assert _rows(spawned.bad) == _rows(threaded.bad) == _rows(generic.bad)
    assert {b.key: b.problem for b in spawned.bad} == bad


async def test_a_check_that_cannot_be_pickled_stays_in_threads(file_kit: StoreKit) -> None:
    for _ in range(30):
        await file_kit.chain(8)
    backend = file_kit.backend
    assert isinstance(backend, FileBackend)
    seen: list[str] = []
    async for batch in backend.read_all("", lambda k, v: k, threads=1, processes=2):
        seen.extend(batch)
    assert len(seen) == len(await file_kit.keys())
