"""A slow, plain-Python model of the HiSparse fused step, written straight from its contract.

State is lists of lists: ``held[row][slot]`` (page, -1 empty) and ``last_used[row][slot]``
(stamp, -1 never). :func:`reference_step` updates both in place and returns ``(slots, miss)``
per stepped row, the same as ``hicache.sparse.hot_step`` does with tensors.
"""

from __future__ import annotations

from collections.abc import Sequence


def reference_row(
    held: list[int], last_used: list[int], wanted: Sequence[int], stamp: int
) -> tuple[list[int], list[bool]]:
    """One row's step: hits keep their slot, misses take unwanted slots in LRU order."""
    slot_of = {page: slot for slot, page in enumerate(held) if page >= 0}
    wanted_pages = {page for page in wanted if page >= 0}
    candidates = [slot for slot, page in enumerate(held) if page not in wanted_pages]
    candidates.sort(key=lambda slot: (last_used[slot], slot))
    victims = iter(candidates)
    slots: list[int] = []
    miss: list[bool] = []
    for page in wanted:
        if page < 0:
            slots.append(-1)
            miss.append(False)
        elif page in slot_of:
            slots.append(slot_of[page])
            miss.append(False)
        else:
            slots.append(next(victims))
            miss.append(True)
    for page, slot in zip(wanted, slots):
        if page >= 0:
            held[slot] = page
            last_used[slot] = stamp
    return slots, miss


def reference_step(
    held: list[list[int]],
    last_used: list[list[int]],
    rows: Sequence[int],
    wanted: Sequence[Sequence[int]],
    stamp: int,
) -> tuple[list[list[int]], list[list[bool]]]:
    """Every stepped row in turn; rows are distinct, so the order does not matter."""
    slots: list[list[int]] = []
    miss: list[list[bool]] = []
    for row, row_wanted in zip(rows, wanted, strict=True):
        row_slots, row_miss = reference_row(held[row], last_used[row], row_wanted, stamp)
        slots.append(row_slots)
        miss.append(row_miss)
    return slots, miss
