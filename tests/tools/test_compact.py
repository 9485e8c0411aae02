"""``compact``: removes exactly the bad, orphaned, stale and over-budget pages, from the tail."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest

from hicache.backends.file import FileBackend, FileConfig
from hicache.backends.file.maintenance import TempFileOwner
from hicache.codec import HEADER_SIZE
from hicache.errors import BadMagicError
from hicache.tools.store.compact import CompactOptions, compact_store
from hicache.tools.store.compact_plan import Reason

if TYPE_CHECKING:
    from store_kit import StoreKit

HOUR = 3600.0


async def damaged_store(kit: StoreKit) -> tuple[dict[str, list[str]], dict[str, Reason]]:
    """Named chains, aged an hour, and the removals a compact with no budget must make."""
    c = {name: await kit.chain(5, tenant=name) for name in "abcdefg"}
    c["z"] = await kit.chain(3, tenant="z", compress=True, payload_bytes=2048)
    expected = {
        c["a"][1]: Reason.CORRUPT,  # payload bit: its three successors are orphans
        c["b"][4]: Reason.TRUNCATED,  # a tail page: nothing hangs below it
        c["c"][2]: Reason.FOREIGN,  # another page's bytes
        c["z"][1]: Reason.CORRUPT,  # compressed payload bit
    }
    await kit.flip_bit(c["a"][1], HEADER_SIZE + 5)
    await kit.truncate(c["b"][4], HEADER_SIZE + 1)
    await kit.copy_page(c["g"][0], c["c"][2])
    await kit.flip_bit(c["z"][1], HEADER_SIZE + 1)
    assert await kit.backend.delete([c["d"][0]]) == [True]  # a chain cut at its root
    await kit.newer_version(c["e"][2])  # kept, and so is what follows it
    for name, start in (("a", 2), ("c", 3), ("d", 1), ("z", 2)):
        expected.update(dict.fromkeys(c[name][start:], Reason.ORPHAN))
    if kit.root is not None:
        kit.age([k for chain in c.values() for k in chain if k != c["d"][0]], HOUR)
    return c, expected


async def test_compact_removes_exactly_what_it_should(file_kit: StoreKit) -> None:
    kit = file_kit
    chains, expected = await damaged_store(kit)
    old_tmp = [kit.temp_file(chains["f"][i], age_s=HOUR) for i in range(3)]
    young_tmp = kit.temp_file(chains["g"][0], age_s=5)
    before = await kit.keys()
    report = await compact_store(kit.backend, CompactOptions())
    assert {r.key: r.reason for r in report.removed} == expected
    assert report.kept == []
    assert sorted(t.path for t in report.temp_files) == sorted(
        str(p.relative_to(kit.root)) for p in old_tmp
    )
    assert not any(p.exists() for p in old_tmp) and young_tmp.exists()
    assert await kit.keys() == before - set(expected)
    removed_bytes = sum(r.bytes for r in report.removed) + 3 * 100
    assert report.bytes_reclaimed == removed_bytes
    # What is left serves: whole chains hit in full, cut chains up to the cut.
    hits = {name: await kit.hits(chain) for name, chain in chains.items()}
    assert hits == {"a": 1, "b": 4, "c": 2, "d": 0, "e": 2, "f": 5, "g": 5, "z": 1}


async def test_dry_run_changes_nothing_and_plans_the_same(file_kit: StoreKit) -> None:
    kit = file_kit
    _, expected = await damaged_store(kit)
    tmp = kit.temp_file("x", age_s=HOUR)
    before = await kit.keys()
    plan = await compact_store(kit.backend, CompactOptions(dry_run=True))
    assert await kit.keys() == before and tmp.exists()
    assert {r.key: r.reason for r in plan.removed} == expected
    assert [t.path for t in plan.temp_files] == [str(tmp.relative_to(kit.root))]
    report = await compact_store(kit.backend, CompactOptions())
    assert [r.to_json() for r in report.removed] == [r.to_json() for r in plan.removed]
    assert json.loads(json.dumps(report.to_json()))["totals"]["orphan"]["objects"] == 10


async def test_memory_store_without_temp_files(memory_kit: StoreKit) -> None:
    kit = memory_kit
    assert not isinstance(kit.backend, TempFileOwner)
    _, expected = await damaged_store(kit)
    report = await compact_store(kit.backend, CompactOptions(grace_s=0))
    assert {r.key: r.reason for r in report.removed} == expected
    assert report.temp_files == []


async def test_young_orphans_are_kept(file_kit: StoreKit) -> None:
    chain = await file_kit.chain(4)
    assert await file_kit.backend.delete([chain[1]]) == [True]
    report = await compact_store(file_kit.backend, CompactOptions(grace_s=60))
    assert report.removed == []  # a writer may still be putting the parent
    file_kit.age(chain[2:], 120)
    report = await compact_store(file_kit.backend, CompactOptions(grace_s=60))
    assert sorted(r.key for r in report.removed) == sorted(chain[2:])


async def test_max_age_evicts_whole_stale_chains_only(file_kit: StoreKit) -> None:
    kit = file_kit
    stale, fresh, extended = [await kit.chain(4) for _ in range(3)]
    kit.age(stale, 3 * HOUR)
    kit.age(extended[:2], 3 * HOUR)  # an old prefix that a recent request continued
    report = await compact_store(kit.backend, CompactOptions(max_age_s=HOUR))
    assert [r.key for r in report.removed] == stale[::-1]  # tail first
    assert {r.reason for r in report.removed} == {Reason.EXPIRED}
    assert [await kit.hits(c) for c in (stale, fresh, extended)] == [0, 4, 4]


async def test_max_bytes_evicts_lru_chains_from_the_tail(file_kit: StoreKit) -> None:
    kit = file_kit
    old, middle, new = [await kit.chain(4, payload_bytes=1000) for _ in range(3)]
    for hours, chain in ((3, old), (2, middle), (1, new)):
        kit.age(chain, hours * HOUR)
    page = len(await kit.read(old[0]))
    report = await compact_store(kit.backend, CompactOptions(max_bytes=int(6.5 * page)))
    removed = [r.key for r in report.removed]
    assert set(removed) == {*old, middle[2], middle[3]}
    assert removed.index(middle[3]) < removed.index(middle[2])
    assert removed.index(old[3]) < removed.index(old[0])
    assert {r.reason for r in report.removed} == {Reason.OVER_BUDGET}
    assert [await kit.hits(c) for c in (old, middle, new)] == [0, 2, 4]
    assert sum([len(await kit.read(k)) for k in await kit.keys()]) <= 6.5 * page


async def test_not_a_store_is_left_alone(file_kit: StoreKit) -> None:
    for i in range(4):
        await file_kit.replace(f"data-{i}", os.urandom(300))
    tmp = file_kit.temp_file("data-0", age_s=HOUR)
    with pytest.raises(BadMagicError):
        await compact_store(file_kit.backend, CompactOptions(max_bytes=1))
    assert len(await file_kit.keys()) == 4 and tmp.exists()


_WRITER = textwrap.dedent(
    """
    import asyncio, json, random, sys
    from hicache.backends.file import FileBackend, FileConfig
    from hicache.keys import RadixKey
    from hicache.tools.bench.stores.store_tools import page_scheme, write_chain

    async def main():
        backend = await FileBackend.open(FileConfig(root=sys.argv[1]))
        scheme, rng, n = page_scheme(), random.Random(5), 0
        while n < 2 or sys.stdin.readline():  # then one chain per line, until EOF
            tokens = [rng.randrange(1 << 31) for _ in range(4 * 16)]
            pages = [rng.randbytes(4096)] * 4
            keys = await write_chain(backend, scheme, RadixKey(tokens, "w"), pages)
            print(json.dumps(keys), flush=True)
            n += 1
        await backend.close()

    asyncio.run(main())
    """
)


async def test_compact_beside_a_writer_loses_nothing(file_kit: StoreKit) -> None:
    kit = file_kit
    chains, expected = await damaged_store(kit)
    stale = [await kit.chain(4, payload_bytes=4096) for _ in range(20)]
    kit.age([k for chain in stale for k in chain], 5 * HOUR)
    expected.update({k: Reason.EXPIRED for chain in stale for k in chain})
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(kit.root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None
    written = [json.loads(writer.stdout.readline()) for _ in range(2)]  # it is running

    async def keep_writing() -> None:
        # Each line asks for one more chain, so the writer works all through the compact.
        while not done.is_set():
            writer.stdin.write("\n")  # type: ignore[union-attr]
            writer.stdin.flush()  # type: ignore[union-attr]
            line = await asyncio.to_thread(writer.stdout.readline)  # type: ignore[union-attr]
            written.append(json.loads(line))

    done = asyncio.Event()
    feeder = asyncio.create_task(keep_writing())
    options = CompactOptions(max_age_s=2 * HOUR, grace_s=60)
    started = len(written)
    report = await compact_store(kit.backend, options)
    done.set()
    await feeder
    during = len(written) - started
    writer.stdin.close()
    assert writer.wait(timeout=10) == 0
    assert during > 0  # the writer did put chains while compact ran
    assert {r.key: r.reason for r in report.removed} == expected
    reopened = await FileBackend.open(FileConfig(root=str(kit.root)))
    try:
        for chain in written:
            assert await reopened.leading_hits(chain) == len(chain)
    finally:
        await reopened.close()
    assert [await kit.hits(chains[n]) for n in "efg"] == [2, 5, 5]
    assert not [p for p in pathlib.Path(kit.root).rglob(".*.tmp")]  # writer's temps published


async def test_report_lines(file_kit: StoreKit) -> None:
    chain = await file_kit.chain(3)
    file_kit.age(chain, 2 * HOUR)
    started = time.time()
    plan = await compact_store(file_kit.backend, CompactOptions(max_age_s=HOUR, dry_run=True))
    lines = plan.lines(verbose=True)
    assert lines[0].startswith("would remove expired") and chain[2] in lines[0]
    assert lines[-1] == f"would reclaim {plan.bytes_reclaimed} bytes"
    assert time.time() - started < 5
