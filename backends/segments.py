"""Buffers as backends see them: a value is one buffer or a list of them (scatter-gather segments).

:func:`as_segments` turns what a caller passes into flat, C-contiguous byte views (the base class
calls it once per value); the other helpers copy between such views and plain byte buffers, and
:func:`split_iov` cuts a vectored write into stretches for several threads.
They are re-exported by :mod:`hicache.backends.base`, where backends import them from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar

from hicache.errors import InvalidArgumentError

__all__ = [
    "IOV_MAX",
    "BufferLike",
    "CopyFn",
    "Segments",
    "as_segments",
    "byte_runs",
    "copy_if_fits",
    "copy_into_segments",
    "fill_from_segments",
    "join_segments",
    "segments_after",
    "segments_nbytes",
    "split_iov",
    "trim",
]

BufferLike: TypeAlias = "bytes | bytearray | memoryview | Any"
Segments: TypeAlias = "BufferLike | Sequence[BufferLike]"
#: How a helper copies one piece, ``copy(destination, source)`` of equal size.
CopyFn: TypeAlias = Callable[[memoryview, memoryview], None]
_FIELD_NAME_RE = re.compile(r":[^:]*:")
#: The most pieces one ``pwritev``/``preadv`` is given here (Linux takes 1024).
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
Piece = TypeVar("Piece", bound="memoryview | bytes")


def as_segments(value: Segments, writable: bool) -> list[memoryview]:
    """``value`` as a list of flat byte views; raises :class:`InvalidArgumentError`."""
    items = value if isinstance(value, (list, tuple)) else (value,)
    out: list[memoryview] = []
    for item in items:
        try:
            view = memoryview(item)
        except (TypeError, ValueError):  # numpy raises ValueError for dtypes with no buffer
            raise InvalidArgumentError(
                f"a buffer must support the buffer protocol, not {type(item).__name__}"
            ) from None
        if not view.c_contiguous:
            raise InvalidArgumentError("buffers must be C-contiguous")
        if writable and view.readonly:
            raise InvalidArgumentError("get_into needs writable buffers")
        if _holds_objects(view.format):
            # Its bytes are object pointers: storing them is meaningless, reading into it unsafe.
            raise InvalidArgumentError("a buffer of Python objects cannot be stored or filled")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        out.append(view)
    return out


def _holds_objects(fmt: str) -> bool:
    """Whether a PEP 3118 format has an object ('O') item; ``:name:`` field labels are skipped."""
    return "O" in fmt and "O" in _FIELD_NAME_RE.sub("", fmt)


def segments_nbytes(segments: Sequence[memoryview]) -> int:
    if len(segments) == 1:  # the common case: one page, one view
        return segments[0].nbytes
    return sum(s.nbytes for s in segments)


def segments_after(segments: Sequence[memoryview], skip: int) -> list[memoryview]:
    """The views left once the first ``skip`` bytes of ``segments`` are done (a partial
    vector read or write goes on from there)."""
    for i, seg in enumerate(segments):
        if skip < seg.nbytes:
            return [seg[skip:], *segments[i + 1 :]]
        skip -= seg.nbytes
    return []


def trim(segments: Sequence[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``segments`` (which hold at least that many), as views."""
    if len(segments) == 1 and segments[0].nbytes == n:
        return [segments[0]]
    out: list[memoryview] = []
    for seg in segments:
        if n <= 0:
            break
        take = min(n, seg.nbytes)
        out.append(seg[:take] if take < seg.nbytes else seg)
        n -= take
    return out


def join_segments(segments: Sequence[memoryview]) -> bytearray:
    """One new buffer holding the segments back to back (one copy)."""
    out = bytearray(segments_nbytes(segments))
    fill_from_segments(segments, out)
    return out


def _assign(dst: memoryview, src: memoryview) -> None:
    dst[:] = src


def fill_from_segments(
    segments: Sequence[memoryview], target: bytearray | memoryview, copy: CopyFn = _assign
) -> None:
    """Copy ``segments`` back to back into ``target``, which holds exactly their bytes."""
    view, offset = memoryview(target), 0
    for seg in segments:
        copy(view[offset : offset + seg.nbytes], seg)
        offset += seg.nbytes


def copy_into_segments(
    source: memoryview, segments: Sequence[memoryview], copy: CopyFn = _assign
) -> None:
    """Copy ``source`` across ``segments`` in order; the caller checked it fits."""
    offset, total = 0, source.nbytes
    for seg in segments:
        if offset >= total:
            return
        n = min(seg.nbytes, total - offset)
        copy(seg[:n], source[offset : offset + n])
        offset += n


def copy_if_fits(data: BufferLike, segments: Sequence[memoryview]) -> int:
    """A read of one object held whole, as ``get_into`` reports it: ``data`` is copied into
    ``segments`` when they can hold it, and its size is returned either way (a size larger
    than the segments tells the caller it did not fit; they are then left untouched)."""
    source = memoryview(data).cast("B")
    if source.nbytes <= segments_nbytes(segments):
        copy_into_segments(source, segments)
    return source.nbytes


def split_iov(iov: list[Piece], offset: int, parts: int) -> list[tuple[list[Piece], int, int]]:
    """``iov`` at file ``offset`` cut into about ``parts`` stretches of similar size (and at
    most ``IOV_MAX`` pieces each): each stretch's pieces, its offset and its size. Lists of
    pieces of the same sizes are cut at the same places."""
    sizes = [memoryview(p).nbytes for p in iov]
    target = max(1, sum(sizes) // max(1, parts))
    out: list[tuple[list[Piece], int, int]] = []
    start = size = 0
    for i, n in enumerate(sizes):
        size += n
        if size >= target or i + 1 - start >= IOV_MAX or i == len(sizes) - 1:
            out.append((iov[start : i + 1], offset, size))
            offset += size
            start, size = i + 1, 0
    return out


def byte_runs(sizes: Sequence[int], most: int) -> list[range]:
    """Positions ``0 .. len(sizes) - 1`` cut, in order, into runs of at most ``most`` bytes in
    all (an item larger than ``most`` is a run of its own)."""
    runs: list[range] = []
    start = held = 0
    for i, n in enumerate(sizes):
        if i > start and held + n > most:
            runs.append(range(start, i))
            start, held = i, 0
        held += n
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs
