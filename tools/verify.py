"""``hicache verify URL``: read every object and check its header, length and payload checksum.

Reads run in bounded parallel batches into reusable buffers (see
:class:`~hicache.tools.store_scan.StoreScanner`); a compressed page is checked against the
checksum of its stored bytes, without decompressing. Bad objects are reported with the reason
(``corrupt``, ``truncated``, ``foreign``, ``unsupported_version``); ``delete_bad`` removes them
once the whole store has been read, each read and checked once more just before (a serving
process may have rewritten it meanwhile). Pages of a newer format version are reported but
never deleted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from hicache.backends.base import StorageBackend
from hicache.tools.progress import Progress
from hicache.tools.store_scan import Problem, ReadMode, ScanOptions, StoreScanner, recheck

__all__ = ["BadObject", "VerifyOptions", "VerifyReport", "verify_store"]


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    delete_bad: bool = False
    prefix: str = ""
    parallel: int = 2  # batches read at once


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
        return out

    def lines(self) -> list[str]:
        """The human-readable report."""
        out = [f"{b.problem.value:<20} {b.key}  {b.detail}" for b in self.bad]
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
    if options.delete_bad:
        removable = [b.key for b in report.bad if b.problem.removable]
        still_bad = await recheck(backend, removable)
        done = await backend.delete(still_bad) if still_bad else []
        report.deleted = [key for key, ok in zip(still_bad, done) if ok]
    return report
