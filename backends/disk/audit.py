"""``hicache verify`` on a ``disk`` store: every segment walked, every damaged stretch named.

Reading objects one by one finds a damaged record as a miss, and then only the key is known.
The audit walks each segment from its header instead, checking every record's header and
payload, and reports each stretch that does not check out with the indexed keys whose records
lay in it: the objects that stretch lost. A stretch with no indexed key in it (the torn tail
of a writer killed mid-append, a record overwritten since) loses nothing and is reported too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hicache.backends.disk.catalog import Catalog
from hicache.backends.disk.format import record_bytes
from hicache.backends.disk.segments import Damaged, Found, list_segments, segment_name, walk_segment

__all__ = ["DamagedRegion", "audit_segments"]


@dataclass(frozen=True, slots=True)
class DamagedRegion:
    segment: str  # the segment file's name
    start: int
    end: int
    keys: tuple[str, ...]  # the indexed objects whose records lay in it

    def to_json(self) -> dict[str, object]:
        return {"segment": self.segment, "start": self.start, "end": self.end,
                "lost": list(self.keys)}  # fmt: skip


def audit_segments(catalog: Catalog) -> list[DamagedRegion]:
    """Every damaged stretch of every segment (blocking; reads every byte once)."""
    with catalog.lock:
        by_segment: dict[int, dict[int, str]] = {}
        for key, (code, off, _, _) in catalog.index.items():
            by_segment.setdefault(code, {})[off] = key
    out: list[DamagedRegion] = []
    for code, st in sorted(list_segments(catalog.dirs.segments).items()):
        fd = catalog.files.fd(code)
        if fd is None:
            out.append(DamagedRegion(segment_name(code), 0, st.st_size,
                                     tuple(sorted(by_segment.get(code, {}).values()))))  # fmt: skip
            continue
        out.extend(_audit_one(code, fd, by_segment.get(code, {})))
    return out


def _audit_one(code: int, fd: int, indexed: dict[int, str]) -> list[DamagedRegion]:
    name = segment_name(code)
    out = []
    last = max(indexed, default=0)
    for item in walk_segment(fd, os.fstat(fd).st_size, payloads=True, until=last + 1):
        if isinstance(item, Found):
            if item.intact:
                continue
            start = item.offset
            end = start + record_bytes(len(item.key), item.length, item.gap)
        else:
            assert isinstance(item, Damaged)
            start, end = item.offset, item.end
        lost = tuple(sorted(k for off, k in indexed.items() if start <= off < end))
        out.append(DamagedRegion(name, start, end, lost))
    return out
