"""``hicache verify URL``: read every object and check its header, length and payload checksum.

Reads run in bounded parallel batches into reusable buffers (see
:class:`~hicache.tools.store.scan.StoreScanner`); a compressed page is checked against the
checksum of its stored bytes, without decompressing. Bad objects are reported with the reason
(``corrupt``, ``truncated``, ``foreign``, ``unsupported_version``); ``delete_bad`` removes them
once the whole store has been read, each read and checked once more just before (a serving
process may have rewritten it meanwhile). Pages of a newer format version are reported but
never deleted.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from hicache.backends.base import StorageBackend
from hicache.backends.file.maintenance import BulkReader, DamagedStretch, SegmentStore
from hicache.tools.progress import Progress
from hicache.tools.store.scan import (
    Damage,
    Problem,
    ReadMode,
    ScanOptions,
    StoreScanner,
    check_whole,
    recheck,
    refuse_store,
)

__all__ = ["BadObject", "VerifyOptions", "VerifyReport", "verify_store"]

_SAMPLE = ScanOptions().sample


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    delete_bad: bool = False
    prefix: str = ""
    parallel: int = 2  # batches read at once
    # Worker processes for the bulk path on small objects (one per core by default): their
    # cost is Python, which one process runs on one core at a time.
    processes: int = field(default_factory=lambda: os.cpu_count() or 1)
    bulk: bool = True  # through the backend's BulkReader (backends/file/maintenance.py), if any


@dataclass(frozen=True, slots=True)
class BadObject:
    key: str
    problem: Problem
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "reason": self.detail, "kind": self.problem.value}


@dataclass(slots=True)
class VerifyReport:
    objects: int = 0
    bytes: int = 0
    vanished: int = 0  # listed, then gone before they were read: removed by someone else
    bad: list[BadObject] = field(default_factory=list)
    deleted: list[str] | None = None  # None unless deletion was asked for
    # Damaged stretches of a segment store's segments (SegmentStore), None for other stores.
    regions: list[DamagedStretch] | None = None

    @property
    def exit_code(self) -> int:
        """1 when bad objects were found (deleted or not), else 0."""
        return 1 if self.bad else 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "objects": self.objects,
            "bytes": self.bytes,
            "vanished": self.vanished,
            "bad": [b.to_json() for b in self.bad],
        }
        if self.deleted is not None:
            out["deleted"] = self.deleted
        if self.regions is not None:
            out["damaged_regions"] = [r.to_json() for r in self.regions]
        return out

    def lines(self) -> list[str]:
        """The human-readable report."""
        out = [f"{b.problem.value:<20} {b.key}  {b.detail}" for b in self.bad]
        for r in self.regions or []:
            out.append(f"damaged region       {r.segment} bytes {r.start}-{r.end}: "
                       f"{len(r.keys)} objects lost")  # fmt: skip
        counts: dict[str, int] = {}
        for b in self.bad:
            counts[b.problem.value] = counts.get(b.problem.value, 0) + 1
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        summary = f"{self.objects} objects, {self.bytes} bytes: {len(self.bad)} bad"
        out.append(summary + (f" ({kinds})" if kinds else ""))
        if self.deleted is not None:
            out.append(f"deleted {len(self.deleted)}")
        return out


async def verify_store(
    backend: StorageBackend, options: VerifyOptions, progress: Progress | None = None
) -> VerifyReport:
    report = VerifyReport()
    if isinstance(backend, SegmentStore):
        # Before the reads: a read that lands on a damaged record forgets it, and then the
        # audit could no longer say which object the stretch held.
        await _audit(backend, options, report)
    if options.bulk and isinstance(backend, BulkReader):
        await _read_bulk(backend, options, report, progress)
    else:
        await _read_scanned(backend, options, report, progress)
    if options.delete_bad:
        removable = [b.key for b in report.bad if b.problem.removable]
        still_bad = await recheck(backend, removable)
        done = await backend.delete(still_bad) if still_bad else []
        report.deleted = [key for key, ok in zip(still_bad, done) if ok]
    return report


async def _audit(backend: SegmentStore, options: VerifyOptions, report: VerifyReport) -> None:
    report.regions = list(await backend.audit_segments())
    for region in report.regions:
        where = f"in the damaged stretch {region.start}-{region.end} of {region.segment}"
        report.bad.extend(
            BadObject(key, Problem.CORRUPT, where)
            for key in region.keys
            if key.startswith(options.prefix)
        )


async def _read_scanned(
    backend: StorageBackend, options: VerifyOptions, report: VerifyReport, progress: Progress | None
) -> None:
    """The generic path: list, then read in batches into reusable buffers, then check."""
    scan = ScanOptions(ReadMode.FULL, prefix=options.prefix, parallel=options.parallel)
    scanner = StoreScanner(backend, scan, progress)
    async with contextlib.aclosing(scanner.stream()) as objects:
        async for obj in objects:
            if obj.problem is not None:
                report.bad.append(BadObject(obj.key, obj.problem, obj.detail))
    report.objects, report.bytes, report.vanished = (
        scanner.objects,
        scanner.nbytes,
        scanner.vanished,
    )


async def _read_bulk(
    backend: BulkReader, options: VerifyOptions, report: VerifyReport, progress: Progress | None
) -> None:
    """The fast path: each object checked by the thread that read it; only results come back.

    Nothing here is per object but a type test and an addition: a small page costs a few
    microseconds in all, so every step on the event loop shows.
    """
    pages_seen = False  # as in StoreScanner: refuse a store whose first objects are no pages
    reads = backend.read_all(
        options.prefix, check_whole, threads=options.parallel, processes=options.processes
    )
    async with contextlib.aclosing(reads) as batches:
        async for batch in batches:
            nbytes = 0
            for result in batch:
                if type(result) is int:
                    nbytes += result
                    pages_seen = True
                else:
                    assert isinstance(result, Damage)
                    nbytes += result.size
                    pages_seen = pages_seen or result.has_magic
                    report.bad.append(BadObject(result.key, result.problem, result.detail))
            report.objects += len(batch)
            report.bytes += nbytes
            if progress is not None:
                progress.advance(len(batch), nbytes)
            if not pages_seen and report.objects >= _SAMPLE:
                refuse_store(report.objects)
    if report.objects and not pages_seen:
        refuse_store(report.objects)
