"""How the ``mooncake`` client moves each object of a batch: straight, scattered or staged.

- direct: one segment (empty ones aside) inside registered memory; ``batch_upsert_from`` or
  ``batch_get_into`` at its address.
- scattered: several segments, each inside registered memory (a page header slot and its
  payload); ``batch_put_from_multi_buffers`` or ``batch_get_into_multi_buffers`` with one
  pointer per segment, so nothing is copied.
- staged: anything else, copied through the client's staging buffer.

Pure bookkeeping over addresses: the client runs the calls.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from hicache.backends._buffers import address_of

__all__ = ["Move", "Plan", "RegisteredRanges", "Scatter", "classify", "trimmed"]


class RegisteredRanges:
    """Sorted, non-overlapping address ranges; answers "does [a, a+n) lie inside one?"."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def contains(self, start: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + nbytes <= self._ends[i]

    def add(self, start: int, nbytes: int) -> None:
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, start + nbytes)

    def remove(self, start: int) -> int | None:
        """Forget the range starting at ``start``; its length, or None if there is none."""
        i = bisect.bisect_left(self._starts, start)
        if i == len(self._starts) or self._starts[i] != start:
            return None
        self._starts.pop(i)
        return self._ends.pop(i) - start

    def overlaps(self, start: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, start + nbytes - 1) - 1
        return i >= 0 and self._ends[i] > start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((s, e - s) for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))


@dataclass(slots=True)
class Move:
    """One object of a single-pointer call: where it moves from or to, and how to finish a
    staged read."""

    index: int
    address: int
    nbytes: int
    segments: list[memoryview] | None = None  # staged: the caller's segments
    staged_at: int = -1  # offset in the staging buffer (or 0 in an oversize buffer)


@dataclass(slots=True)
class Scatter:
    """One object moved straight between the store and several registered segments."""

    index: int
    addresses: list[int]
    sizes: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass(slots=True)
class Plan:
    """A batch sorted by how each object moves; ``staged`` holds (index, segments, bytes)."""

    direct: list[Move] = field(default_factory=list)
    scattered: list[Scatter] = field(default_factory=list)
    staged: list[tuple[int, list[memoryview], int]] = field(default_factory=list)


def classify(
    items: Sequence[list[memoryview]],
    regions: RegisteredRanges,
    room: Callable[[list[memoryview]], int],
) -> Plan:
    """Sort ``items`` by how they move; ``room(segs)`` is a value's bytes or a buffer's room.

    Empty segments are left out: their address may lie anywhere, and they carry nothing.
    """
    plan = Plan()
    for i, segs in enumerate(items):
        nbytes = room(segs)
        pieces = [(address_of(s), s.nbytes) for s in segs if s.nbytes]
        if nbytes > 0 and all(regions.contains(a, n) for a, n in pieces):
            if len(pieces) == 1:
                plan.direct.append(Move(i, pieces[0][0], nbytes))
            else:
                plan.scattered.append(Scatter(i, [a for a, _ in pieces], [n for _, n in pieces]))
        else:
            plan.staged.append((i, segs, nbytes))
    return plan


def trimmed(scatter: Scatter, nbytes: int) -> Scatter:
    """The same object over just the first ``nbytes`` of its segments (a read whose buffers
    are larger than the object: Mooncake's multi-buffer read needs them exact)."""
    addresses: list[int] = []
    sizes: list[int] = []
    left = nbytes
    for address, n in zip(scatter.addresses, scatter.sizes, strict=True):
        if left <= 0:
            break
        addresses.append(address)
        sizes.append(min(n, left))
        left -= n
    return Scatter(scatter.index, addresses, sizes)
