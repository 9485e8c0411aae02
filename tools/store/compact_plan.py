"""What ``hicache compact`` removes, decided from one scan of the store; no I/O here.

Pages form chains through the parent hash in their headers (see :mod:`hicache.codec`): a page
whose parent is absent, bad or itself unreachable is an **orphan** and can never be hit again.
Live pages (reachable from a chain's first page) are evicted by age and by size as **chains**,
least recently used first and always from the tail: a page's *recency* is the newest write time
in its subtree, so a prefix that some later page extends counts as recent as that page, and
sorting by ``(recency, -depth)`` puts every child before its parent. Evicting any prefix of that
order therefore never leaves a surviving page without its parent.

Pages under keys of another shape have no known chain: each is a chain of one. Pages of a
format version this build cannot read are kept, and so are their ancestors. Orphans written in
the last ``grace_s`` seconds are kept too: a writer may still be putting their parents.

Memory: about 300 bytes per page (key, parent key and a few numbers), so a million pages plan
in about 300 MB.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from hicache.backends.file.maintenance import TEMP_GRACE_S
from hicache.tools.store.scan import Problem, ScannedObject, parse_page_key

__all__ = ["Budget", "Reason", "Removal", "StorePlanner"]

_UNSET, _ORPHAN, _ROOT_PARENT = -3, -2, -1


class Reason(enum.Enum):
    CORRUPT = "corrupt"
    TRUNCATED = "truncated"
    FOREIGN = "foreign"
    ORPHAN = "orphan"
    EXPIRED = "expired"  # the whole chain below it is older than max_age
    OVER_BUDGET = "over_budget"  # least recently used beyond max_bytes

    @property
    def is_bad(self) -> bool:
        return self in (Reason.CORRUPT, Reason.TRUNCATED, Reason.FOREIGN)


_BAD_REASON = {
    Problem.CORRUPT: Reason.CORRUPT,
    Problem.TRUNCATED: Reason.TRUNCATED,
    Problem.FOREIGN: Reason.FOREIGN,
}


@dataclass(frozen=True, slots=True)
class Removal:
    key: str
    reason: Reason
    bytes: int
    depth: int = -1  # position below its chain's first page; evictions go deepest first
    missing: str | None = None  # ORPHAN: the absent ancestor that cuts it off, if known

    def to_json(self) -> dict[str, object]:
        return {"key": self.key, "reason": self.reason.value, "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class Budget:
    now: float  # the time the scan started
    max_bytes: int | None = None
    max_age_s: float | None = None
    grace_s: float = TEMP_GRACE_S


class _Page:
    __slots__ = ("depth", "missing", "mtime", "parent", "pinned", "recency", "size")

    def __init__(self, size: int, mtime: float, parent: str | None, pinned: bool) -> None:
        self.size = size
        self.mtime = mtime
        self.parent = parent
        self.pinned = pinned
        self.depth = _UNSET
        self.recency = math.inf if pinned else mtime
        self.missing: str | None = None


class StorePlanner:
    """Feed it every scanned object with :meth:`add`, then ask for the :meth:`plan`."""

    def __init__(self) -> None:
        self._pages: dict[str, _Page] = {}
        self._bad: list[Removal] = []

    def add(self, obj: ScannedObject) -> None:
        size = obj.info.size
        if obj.problem is not None and obj.problem.removable:
            self._bad.append(Removal(obj.key, _BAD_REASON[obj.problem], size))
            return
        parent = None
        parts = parse_page_key(obj.key)
        if parts is not None and obj.header is not None:  # None: a version this build can't read
            parent = parts.parent_key(obj.header.meta.parent_hash)
        self._pages[obj.key] = _Page(size, obj.info.mtime, parent, pinned=obj.problem is not None)

    def plan(self, budget: Budget) -> list[Removal]:
        """Removals in the order to carry them out: bad, orphans, then chain tails first."""
        self._resolve_depths()
        young = budget.now - budget.grace_s
        orphans = [
            Removal(key, Reason.ORPHAN, page.size, missing=page.missing)
            for key, page in self._pages.items()
            if page.depth == _ORPHAN and page.mtime < young
        ]
        live = sorted(
            ((k, p) for k, p in self._pages.items() if p.depth >= 0),
            key=lambda item: item[1].depth,
            reverse=True,
        )
        for _, page in live:  # deepest first, so a parent sees its children's final recency
            parent = self._pages.get(page.parent) if page.parent else None
            if parent is not None and parent.depth >= 0:
                parent.recency = max(parent.recency, page.recency)
        evictions = self._evict(live, orphans, budget)
        evictions.sort(key=lambda r: r.depth, reverse=True)
        return [*self._bad, *orphans, *evictions]

    def _evict(
        self, live: list[tuple[str, _Page]], orphans: list[Removal], budget: Budget
    ) -> list[Removal]:
        out: list[Removal] = []
        rest: list[tuple[str, _Page]] = []
        cutoff = -math.inf if budget.max_age_s is None else budget.now - budget.max_age_s
        for key, page in live:
            if page.recency < cutoff:
                out.append(Removal(key, Reason.EXPIRED, page.size, page.depth))
            elif page.recency != math.inf:
                rest.append((key, page))
        if budget.max_bytes is None:
            return out
        removed = sum(r.bytes for r in out) + sum(r.bytes for r in orphans)
        total = sum(p.size for p in self._pages.values()) - removed
        rest.sort(key=lambda item: (item[1].recency, -item[1].depth))
        for key, page in rest:
            if total <= budget.max_bytes:
                break
            out.append(Removal(key, Reason.OVER_BUDGET, page.size, page.depth))
            total -= page.size
        return out

    def _resolve_depths(self) -> None:
        """Each page's depth in its chain, or ``_ORPHAN`` with the missing ancestor noted."""
        pages = self._pages
        for start in pages:
            path: list[_Page] = []
            on_path: set[str] = set()
            key: str | None = start
            while key is not None and key not in on_path:
                page = pages.get(key)
                if page is None or page.depth != _UNSET:
                    break
                on_path.add(key)
                path.append(page)
                key = page.parent
            base, missing = self._base_of(key, on_path)
            for page in reversed(path):
                if base == _ORPHAN:
                    page.depth, page.missing = _ORPHAN, missing
                else:
                    base += 1
                    page.depth = base

    def _base_of(self, key: str | None, on_path: set[str]) -> tuple[int, str | None]:
        """Depth of the page above a walked path (``_ROOT_PARENT`` above a first page)."""
        if key is None:
            return _ROOT_PARENT, None
        if key in on_path:  # a cycle: no hash chain can make one, only a broken writer
            return _ORPHAN, None
        page = self._pages.get(key)
        if page is None:
            return _ORPHAN, key
        return page.depth, page.missing
