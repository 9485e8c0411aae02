"""The store tools on a ``disk://`` store: ``verify`` names damaged segment stretches and the
objects they lost, ``compact`` frees the segments its deletions emptied, and the reading tools
write nothing."""

from __future__ import annotations

import asyncio
import io
import os
import pathlib
import random

import pytest
from store_kit import StoreKit

from hicache.backends.disk import DiskBackend, DiskConfig
from hicache.backends.disk.segments import segment_name
from hicache.tools.store.compact import CompactOptions, compact_store
from hicache.tools.store.inspect import InspectOptions, inspect_store
from hicache.tools.store.scan import open_store
from hicache.tools.store.verify import VerifyOptions, verify_store

pytestmark = pytest.mark.asyncio
_SEGMENT = 64 << 10


async def _filled(root: pathlib.Path, chains: int = 6) -> list[list[str]]:
    backend = await DiskBackend.open(DiskConfig(root=str(root), segment_bytes=_SEGMENT))
    kit = StoreKit(backend, root)
    out = [await kit.chain(8, payload_bytes=2048) for _ in range(chains)]
    await backend.close()
    return out


def _tree(root: pathlib.Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()
    }


async def test_verify_names_the_damaged_stretch_and_what_it_lost(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "store"
    chains = await _filled(root)
    store = await DiskBackend.open(DiskConfig(root=str(root)))
    victim = chains[2][3]
    code, offset, length, _ = store.catalog.index.get(victim)  # type: ignore[misc]
    await store.close()
    seg_file = root / "segments" / segment_name(code)
    with open(seg_file, "r+b") as f:  # a payload byte in the middle of the victim's record
        f.seek(offset + 40 + len(victim) + length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    store = await open_store(f"disk://{root}", read_only=True)
    before = _tree(root)
    try:
        report = await verify_store(store, VerifyOptions(processes=1))
    finally:
        await store.close()
    assert _tree(root) == before, "a read-only verify wrote to the store"
    assert [b.key for b in report.bad] == [victim]
    assert report.regions is not None and len(report.regions) == 1
    region = report.regions[0]
    assert region.segment == seg_file.name and region.keys == (victim,)
    assert region.start == offset and region.end > offset + length
    assert report.to_json()["damaged_regions"][0]["lost"] == [victim]
    assert report.exit_code == 1


async def test_compact_evictions_free_their_segments(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "store"
    chains = await _filled(root)
    store = await DiskBackend.open(DiskConfig(root=str(root)))
    segments_before = len(list((root / "segments").iterdir()))
    # Over budget: the planner evicts whole chains from their tails.
    report = await compact_store(store, CompactOptions(max_bytes=2 * 8 * 2300, grace_s=0.0))
    stats = await store.stats()
    survivors = [k for c in chains for k in c if (await store.exists([k]))[0]]
    for key in survivors:
        assert (await store.get([key]))[0] is not None
    await store.close()
    assert len(report.removed) == 48 - len(survivors) > 0
    assert len(list((root / "segments").iterdir())) < segments_before
    assert stats["disk_bytes"] <= 2 * _SEGMENT + 2 * 8 * 2300
    assert await _inspect(root) == len(survivors)


async def test_compact_moves_live_objects_out_of_half_dead_segments(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "store"
    chains = await _filled(root)
    keys = [k for chain in chains for k in chain]
    store = await DiskBackend.open(DiskConfig(root=str(root)))
    # Whole chains go (a page whose parent is gone is an orphan compact would remove).
    kept = {k: (await store.get([k]))[0] for chain in chains[::3] for k in chain}
    assert await store.delete([k for k in keys if k not in kept]) == [True] * (
        len(keys) - len(kept)
    )
    before = await store.stats()
    report = await compact_store(store, CompactOptions(grace_s=0.0))
    after = await store.stats()
    assert report.segments_compacted > 0 and report.segment_bytes_freed > 0
    # Segments are allocated whole: the live third moved into fewer of them.
    assert after["segments"] < before["segments"]
    assert after["disk_bytes"] <= before["disk_bytes"] - report.segment_bytes_freed + _SEGMENT
    assert {k: (await store.get([k]))[0] for k in kept} == kept
    await store.close()
    reopened = await DiskBackend.open(DiskConfig(root=str(root)))
    assert {k: (await reopened.get([k]))[0] for k in kept} == kept
    assert (await reopened.stats())["objects"] == len(kept)
    await reopened.close()


async def _inspect(root: pathlib.Path) -> int:
    store = await open_store(f"disk://{root}", read_only=True)
    try:
        summary = await inspect_store(store, InspectOptions(), io.StringIO())
    finally:
        await store.close()
    return summary.total.objects


async def test_compact_max_age_expires_by_write_time(tmp_path: pathlib.Path) -> None:
    """--max-age on a disk store: ages are write times (the records' sequences), so pages
    written before the cut go, newer ones stay, and the emptied segments are freed."""
    root = tmp_path / "store"
    old = await _filled(root, chains=3)
    await asyncio.sleep(1.5)
    store = await DiskBackend.open(DiskConfig(root=str(root)))
    kit = StoreKit(store, root)
    kit.rng = random.Random(99)  # other tokens than _filled's kit: other keys
    new = [await kit.chain(8, payload_bytes=2048) for _ in range(2)]
    report = await compact_store(store, CompactOptions(max_age_s=1.0, grace_s=0.0))
    present = {k: (await store.exists([k]))[0] for c in old + new for k in c}
    stats = await store.stats()
    await store.close()
    assert {r.key for r in report.removed} == {k for c in old for k in c}
    assert all(present[k] for c in new for k in c)
    assert stats["objects"] == 16 and stats["segments"] <= 2
