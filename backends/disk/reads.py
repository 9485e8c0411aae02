"""The ``disk`` backend's reads: records straight into the callers' buffers, checked.

Records that lie back to back in one segment (a prefix stored in one batch does) are read with
one ``preadv``: their headers and padding into a scratch buffer, their payloads into the
callers' segments. Each record is then checked against its index entry (key, length, write
sequence, header CRC) and its payload against the xxh3 in its header; one that fails is a miss
and is reported, so the index forgets it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.backends.base import MISS
from hicache.backends.disk.format import (
    RECORD_HEADER,
    parse_record_header,
    payload_hash,
    record_bytes,
)
from hicache.backends.disk.index import Entry
from hicache.backends.disk.segments import SegmentFiles

__all__ = ["ReadItem", "read_records", "trim"]

_IOV_MAX = 1024


@dataclass(frozen=True, slots=True)
class ReadItem:
    key: str
    entry: Entry  # segment code, offset, length, sequence
    target: list[memoryview]  # exactly ``length`` bytes of the caller's buffer


def trim(segs: Sequence[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``segs`` (which hold at least that many), as views."""
    out: list[memoryview] = []
    for s in segs:
        if n <= 0:
            break
        take = min(n, s.nbytes)
        out.append(s[:take] if take < s.nbytes else s)
        n -= take
    return out


def read_records(files: SegmentFiles, items: list[ReadItem]) -> tuple[list[int], list[int]]:
    """Each item's length, or MISS; and the positions of items whose record failed a check."""
    results = [MISS] * len(items)
    bad: list[int] = []
    order = sorted(range(len(items)), key=lambda i: items[i].entry[:2])
    run: list[int] = []
    iov = 0  # iovecs the run needs: a header, the payload's segments, maybe padding
    for i in order:
        need = 2 + len(items[i].target)
        if run and not (_follows(items[run[-1]], items[i]) and iov + need <= _IOV_MAX):
            _read_run(files, items, run, results, bad)
            run, iov = [], 0
        run.append(i)
        iov += need
    if run:
        _read_run(files, items, run, results, bad)
    return results, bad


def _follows(prev: ReadItem, item: ReadItem) -> bool:
    p_seg, p_off, p_len, _ = prev.entry
    seg, off, _, _ = item.entry
    return seg == p_seg and off == p_off + record_bytes(len(prev.key), p_len)


def _read_run(
    files: SegmentFiles, items: list[ReadItem], run: list[int], results: list[int], bad: list[int]
) -> None:
    first = items[run[0]].entry
    fd = files.fd(first[0])
    if fd is None:
        return  # the segment is gone (reclaimed): misses
    sizes = [record_bytes(len(items[i].key), items[i].entry[2]) for i in run]
    heads = [RECORD_HEADER + len(items[i].key) for i in run]
    overhead = sum(s - items[i].entry[2] for s, i in zip(sizes, run, strict=True))
    scratch = memoryview(bytearray(overhead))
    iov: list[memoryview] = []
    spots: list[tuple[memoryview, int]] = []  # each record's header view, its end in the run
    pos = end = 0
    for i, size, head in zip(run, sizes, heads, strict=True):
        length = items[i].entry[2]
        hview = scratch[pos : pos + head]
        pad = size - head - length
        iov.append(hview)
        iov.extend(items[i].target)
        if pad:
            iov.append(scratch[pos + head : pos + head + pad])
        pos += head + pad
        end += size
        spots.append((hview, end))
    try:
        got = os.preadv(fd, iov, first[1])
    except OSError:
        return  # a descriptor closed under us by a reclaim, an I/O error: misses
    for k, (i, (hview, rec_end)) in enumerate(zip(run, spots, strict=True)):
        if rec_end > got:
            # A short read: the segment was cut short (by hand); the rest are misses, and
            # damaged ones (forgotten), else `exists` kept reporting them forever.
            bad.extend(run[k:])
            return
        item = items[i]
        h = parse_record_header(hview, item.key.encode("ascii"))
        _, _, length, seq = item.entry
        if (
            h is None
            or h.length != length
            or h.seq != seq
            or payload_hash(item.target) != h.payload_hash
        ):
            bad.append(i)
            continue
        results[i] = length
