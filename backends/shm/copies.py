"""Copy planning for the ``shm`` backend: scatter-gather pieces, and splitting a batch.

Pure functions over numpy views; :mod:`hicache.backends.shm.backend` runs them in worker threads.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MIN_PART_BYTES", "as_arrays", "plan_copy", "run_copies", "split_batch"]

MIN_PART_BYTES = 8 << 20  # below this, another thread costs more than it saves


def split_batch(sizes: list[int], parts: int) -> list[range]:
    """Contiguous ranges of the batch with about equal bytes, each at least MIN_PART_BYTES."""
    total = sum(sizes)
    parts = max(1, min(parts, total // MIN_PART_BYTES, len(sizes)))
    if parts == 1:
        return [range(len(sizes))]
    out: list[range] = []
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(sizes)))
    return [r for r in out if len(r)]


def as_arrays(segments: list[memoryview]) -> list[np.ndarray]:
    return [np.frombuffer(s, dtype=np.uint8) for s in segments]


def plan_copy(
    src: list[np.ndarray], dst: list[np.ndarray], plan: list[tuple[np.ndarray, np.ndarray]]
) -> None:
    """Add the (destination, source) slice pairs that copy ``src`` into ``dst`` in order.

    Copies are planned first and run back to back: Python work between 2 MiB copies runs
    with cold caches and costs several times more.
    """
    if len(src) == 1 and len(dst) == 1 and src[0].size <= dst[0].size:
        plan.append((dst[0][: src[0].size], src[0]))  # the usual case: one piece each side
        return
    si = di = s_off = d_off = 0
    while si < len(src) and di < len(dst):
        s, d = src[si], dst[di]
        n = min(s.size - s_off, d.size - d_off)
        if n:
            plan.append((d[d_off : d_off + n], s[s_off : s_off + n]))
        s_off += n
        d_off += n
        if s_off == s.size:
            si, s_off = si + 1, 0
        if d_off == d.size:
            di, d_off = di + 1, 0


def run_copies(plan: list[tuple[np.ndarray, np.ndarray]]) -> None:
    # numpy.copyto releases the GIL for large copies: the event loop keeps running.
    copyto = np.copyto
    for dst, src in plan:
        copyto(dst, src)
