"""``hicache compact URL``: remove what can never be hit again and keep the store in budget.

One scan reads every object (``headers_only`` skips the payload checksums), then
:class:`~hicache.tools.store.compact_plan.StorePlanner` decides; see there for orphans and for how
``max_bytes`` and ``max_age_s`` evict chains from the tail. Age is the object's write time as
the backend's ``scan`` reports it; for the file backend that is the file's mtime, which reads
do not refresh, so "least recently used" means least recently written.

Safe beside a serving process that reads and writes the same store:

- Each object is removed by one backend ``delete``, which is atomic (the file backend unlinks;
  a reader holding the file open keeps reading the old inode), so no reader sees half a page.
- Nothing being written is touched: temporary files younger than ``grace_s`` are kept (and
  their age is read again at the moment of removal), objects published after the scan began
  are not in the plan, and orphans younger than ``grace_s`` are kept, since a writer may be
  putting their parents.
- Just before deletion, bad objects are read and checked again, and the missing parent of each
  orphan is looked up again: a page rewritten or reconnected meanwhile is kept.
- Chain evictions run in waves, deepest pages first, so a prefix is never removed while its
  continuation is still there.

What remains racy: a chain extended between the scan and the eviction of its old tail loses
the extension's link (the extension becomes an orphan, removed by a later compact). That costs
a cache miss, never a wrong hit.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.backends.base import StorageBackend
from hicache.backends.file.maintenance import (
    TEMP_GRACE_S,
    SegmentStore,
    TempFile,
    TempFileOwner,
)
from hicache.tools.progress import Progress
from hicache.tools.store.compact_plan import Budget, Reason, Removal, StorePlanner
from hicache.tools.store.scan import ReadMode, ScanOptions, StoreScanner, recheck

__all__ = ["CompactOptions", "CompactReport", "compact_store"]

ProgressFactory = Callable[[str, "int | None"], Progress]
_DELETE_BATCH = 256
_EXISTS_BATCH = 1024
# A segment at least half dead is rewritten: moving its live half costs at most what it frees.
_SEGMENT_MIN_DEAD = 0.5


@dataclass(frozen=True, slots=True)
class CompactOptions:
    max_bytes: int | None = None
    max_age_s: float | None = None
    dry_run: bool = False
    grace_s: float = TEMP_GRACE_S
    headers_only: bool = False
    parallel: int = 2


@dataclass(slots=True)
class CompactReport:
    dry_run: bool
    objects: int = 0
    bytes: int = 0
    vanished: int = 0
    removed: list[Removal] = field(default_factory=list)  # planned, in a dry run
    kept: list[Removal] = field(default_factory=list)  # planned, then found fine again
    temp_files: list[TempFile] = field(default_factory=list)
    # A segment store's (SegmentStore) segments emptied and unlinked after the deletions.
    segments_compacted: int = 0
    segment_bytes_freed: int = 0

    @property
    def bytes_reclaimed(self) -> int:
        """Objects and temporary files removed; a segment store's freed segments are counted
        apart (``segment_bytes_freed``), since its deletions free no bytes by themselves."""
        return sum(r.bytes for r in self.removed) + sum(t.size for t in self.temp_files)

    def totals(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for r in self.removed:
            entry = out.setdefault(r.reason.value, {"objects": 0, "bytes": 0})
            entry["objects"] += 1
            entry["bytes"] += r.bytes
        if self.temp_files:
            out["temp"] = {
                "objects": len(self.temp_files),
                "bytes": sum(t.size for t in self.temp_files),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "objects": self.objects,
            "bytes": self.bytes,
            "vanished": self.vanished,
            "removed": [r.to_json() for r in self.removed],
            "kept_on_recheck": [r.to_json() for r in self.kept],
            "temp_files": [
                {"path": t.path, "bytes": t.size, "age_s": round(t.age_s, 1)}
                for t in self.temp_files
            ],
            "totals": self.totals(),
            "bytes_reclaimed": self.bytes_reclaimed,
            "segments_compacted": self.segments_compacted,
            "segment_bytes_freed": self.segment_bytes_freed,
        }

    def lines(self, verbose: bool) -> list[str]:
        verb = "would remove" if self.dry_run else "removed"
        out: list[str] = []
        if verbose:
            out += [f"{verb} {r.reason.value:<12} {r.bytes:>12} {r.key}" for r in self.removed]
            out += [f"{verb} {'temp':<12} {t.size:>12} {t.path}" for t in self.temp_files]
        out.append(f"scanned {self.objects} objects, {self.bytes} bytes")
        for reason, t in sorted(self.totals().items()):
            out.append(f"{verb} {t['objects']} {reason} ({t['bytes']} bytes)")
        out.append(
            f"{'would reclaim' if self.dry_run else 'reclaimed'} {self.bytes_reclaimed} bytes"
        )
        if self.segments_compacted:
            out.append(f"compacted {self.segments_compacted} segments, freed "
                       f"{self.segment_bytes_freed} bytes")  # fmt: skip
        return out


def _no_progress(label: str, total: int | None) -> Progress:
    return Progress(label, total, enabled=False)


async def compact_store(
    backend: StorageBackend,
    options: CompactOptions,
    progress: ProgressFactory = _no_progress,
) -> CompactReport:
    report = CompactReport(dry_run=options.dry_run)
    budget = Budget(time.time(), options.max_bytes, options.max_age_s, options.grace_s)
    planner = StorePlanner()
    mode = ReadMode.HEADERS if options.headers_only else ReadMode.FULL
    with progress("scan", None) as bar:
        scanner = StoreScanner(backend, ScanOptions(mode, parallel=options.parallel), bar)
        async with contextlib.aclosing(scanner.stream()) as objects:
            async for obj in objects:
                planner.add(obj)
    report.objects, report.bytes, report.vanished = (
        scanner.objects,
        scanner.nbytes,
        scanner.vanished,
    )
    plan = planner.plan(budget)
    if options.dry_run:
        report.removed = plan
        if isinstance(backend, TempFileOwner):
            report.temp_files = [
                t async for t in backend.scan_temp_files() if t.age_s >= options.grace_s
            ]
        return report
    with progress("delete", len(plan)) as bar:
        await _carry_out(backend, plan, report, bar)
    if isinstance(backend, TempFileOwner):
        report.temp_files = await backend.remove_temp_files(options.grace_s)
    if isinstance(backend, SegmentStore):
        # Deleting marks objects dead; the disk comes back when their segments go.
        count, freed = await backend.compact_segments(_SEGMENT_MIN_DEAD)
        report.segments_compacted, report.segment_bytes_freed = count, freed
    return report


async def _carry_out(
    backend: StorageBackend, plan: list[Removal], report: CompactReport, bar: Progress
) -> None:
    bad = [r for r in plan if r.reason.is_bad]
    still_bad = set(await recheck(backend, [r.key for r in bad]))
    await _delete(backend, bad, still_bad, report, bar)
    # After the bad ones are gone: an orphan cut off by a bad page must find it missing.
    orphans = [r for r in plan if r.reason is Reason.ORPHAN]
    links = sorted({r.missing for r in orphans if r.missing is not None})
    back = await _present(backend, links)
    cut_off = {r.key for r in orphans if r.missing not in back}
    await _delete(backend, orphans, cut_off, report, bar)
    evictions = [r for r in plan if r.reason in (Reason.EXPIRED, Reason.OVER_BUDGET)]
    for _, wave in itertools.groupby(evictions, key=lambda r: r.depth):
        group = list(wave)
        await _delete(backend, group, {r.key for r in group}, report, bar)


async def _present(backend: StorageBackend, keys: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for start in range(0, len(keys), _EXISTS_BATCH):
        chunk = keys[start : start + _EXISTS_BATCH]
        found.update(k for k, ok in zip(chunk, await backend.exists(chunk)) if ok)
    return found


async def _delete(
    backend: StorageBackend,
    planned: list[Removal],
    confirmed: set[str],
    report: CompactReport,
    bar: Progress,
) -> None:
    """Delete the confirmed removals, in batches; the rest are reported as kept."""
    go = [r for r in planned if r.key in confirmed]
    report.kept.extend(r for r in planned if r.key not in confirmed)
    for start in range(0, len(go), _DELETE_BATCH):
        chunk = go[start : start + _DELETE_BATCH]
        done = await backend.delete([r.key for r in chunk])
        # False: gone already (evicted by a serving process); not ours to count as reclaimed.
        report.removed.extend(r for r, ok in zip(chunk, done) if ok)
        bar.advance(len(chunk), sum(r.bytes for r in chunk))
