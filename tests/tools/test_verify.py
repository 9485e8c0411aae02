"""``verify``: finds exactly the damaged objects, with the reason, in bounded parallel reads."""

from __future__ import annotations

import asyncio

import pytest
from store_kit import StoreKit

from hicache.backends.base import MISS, ObjectInfo, StorageBackend
from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import WrapperBackend
from hicache.codec import HEADER_SIZE
from hicache.errors import BadMagicError
from hicache.tools.store.scan import Problem, ReadMode, ScanOptions, StoreScanner
from hicache.tools.store.verify import VerifyOptions, verify_store


async def damage(kit: StoreKit) -> tuple[list[list[str]], dict[str, Problem]]:
    """Six chains, one compressed; damage one page of most. The chains and what is bad."""
    chains = [await kit.chain(4, tenant=f"t{i % 2}") for i in range(5)]
    chains.append(await kit.chain(3, compress=True))
    a, b, c, d, e, z = chains
    await kit.flip_bit(a[1], HEADER_SIZE + 7)  # payload bit
    await kit.flip_bit(b[3], 40)  # header bit (parent hash), caught by the header checksum
    await kit.truncate(c[2], HEADER_SIZE + 100)
    await kit.copy_page(e[0], d[1])  # intact page, other key
    await kit.replace("not-a-page", b"plain bytes, no header" * 20)
    await kit.newer_version(e[3])
    await kit.flip_bit(z[2], HEADER_SIZE + 3)  # compressed payload
    bad = {
        a[1]: Problem.CORRUPT,
        b[3]: Problem.CORRUPT,
        c[2]: Problem.TRUNCATED,
        d[1]: Problem.FOREIGN,
        "not-a-page": Problem.FOREIGN,
        e[3]: Problem.UNSUPPORTED,
        z[2]: Problem.CORRUPT,
    }
    return chains, bad


async def test_verify_finds_exactly_the_damaged_set(kit: StoreKit) -> None:
    chains, bad = await damage(kit)
    report = await verify_store(kit.backend, VerifyOptions())
    assert report.objects == sum(map(len, chains)) + 1
    assert {b.key: b.problem for b in report.bad} == bad
    assert report.exit_code == 1
    reasons = {b.key: b.detail for b in report.bad}
    assert "payload checksum" in reasons[chains[0][1]]
    assert "another key" in reasons[chains[3][1]]
    as_json = report.to_json()
    assert set(as_json) >= {"objects", "bad"} and "deleted" not in as_json
    assert {row["key"] for row in as_json["bad"]} == set(bad)
    assert all(set(row) >= {"key", "reason"} for row in as_json["bad"])


async def test_delete_bad_removes_all_but_newer_versions(kit: StoreKit) -> None:
    chains, bad = await damage(kit)
    report = await verify_store(kit.backend, VerifyOptions(delete_bad=True))
    newer = [k for k, p in bad.items() if p is Problem.UNSUPPORTED]
    assert report.deleted is not None and sorted(report.deleted) == sorted(set(bad) - set(newer))
    assert report.exit_code == 1  # bad objects were found, even though they are gone now
    again = await verify_store(kit.backend, VerifyOptions())
    assert [b.key for b in again.bad] == newer
    assert await kit.keys() == {k for chain in chains for k in chain} - set(report.deleted)


async def test_a_clean_store_verifies(kit: StoreKit) -> None:
    chains = [await kit.chain(5, compress=i == 0) for i in range(3)]
    report = await verify_store(kit.backend, VerifyOptions())
    assert (report.objects, report.bad, report.exit_code) == (15, [], 0)
    sizes = [len(await kit.read(k)) for chain in chains for k in chain]
    assert report.bytes == sum(sizes)


async def test_empty_store(kit: StoreKit) -> None:
    report = await verify_store(kit.backend, VerifyOptions())
    assert (report.objects, report.bad, report.exit_code) == (0, [], 0)


async def test_a_store_of_other_objects_is_refused(kit: StoreKit) -> None:
    for i in range(5):
        await kit.replace(f"other-{i}", b"not a page at all" * 30)
    with pytest.raises(BadMagicError, match="not a hicache store"):
        await verify_store(kit.backend, VerifyOptions(delete_bad=True))
    assert len(await kit.keys()) == 5  # nothing deleted


class _Probe(WrapperBackend):
    """Counts reads in flight; can make one key vanish or grow between listing and read."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.in_flight = 0
        self.peak = 0
        self.vanish: set[str] = set()
        self.shrink_listing: set[str] = set()

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(0.001)  # let the scanner start whatever else it would
            results = await super()._get_into(keys, buffers)
        finally:
            self.in_flight -= 1
        return [MISS if k in self.vanish else n for k, n in zip(keys, results)]

    async def _scan(self, prefix: str):  # type: ignore[no-untyped-def]
        async for info in self.inner.scan(prefix):
            if info.key in self.shrink_listing:  # listed before a rewrite made it larger
                info = ObjectInfo(info.key, info.size - 50, info.mtime)
            yield info


@pytest.mark.parametrize("parallel", [1, 3])
async def test_reads_are_bounded_and_batched(parallel: int) -> None:
    inner = MemoryBackend()
    probe = _Probe(inner)
    kit = StoreKit(inner, None)
    for _ in range(40):
        await kit.chain(8, payload_bytes=64)
    options = ScanOptions(ReadMode.FULL, parallel=parallel, batch_objects=10)
    scanner = StoreScanner(probe, options)
    seen = [obj.key async for obj in scanner]
    assert len(seen) == len(set(seen)) == 320 == scanner.objects
    assert probe.peak == parallel


async def test_vanished_and_grown_objects(memory_kit: StoreKit) -> None:
    chain = await memory_kit.chain(6)
    probe = _Probe(memory_kit.backend)
    probe.vanish = {chain[2]}
    probe.shrink_listing = {chain[4]}
    report = await verify_store(probe, VerifyOptions())
    assert (report.objects, report.vanished, report.bad) == (5, 1, [])
