"""Pages that live as several contiguous pieces of a host pool, stored as one hicache page.

An engine's host pool often holds a page as a strided view: K and V apart, or one piece per
layer. Copying such a page into one buffer before every write (and out of one after every read)
costs a memcpy per page; instead its contiguous *runs* go to the backend as scatter-gather
segments behind the codec's header. The stored object is byte for byte what
:func:`hicache.codec.encode_page` makes of the joined payload, so ``hicache verify`` and every
other reader check it the usual way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import xxhash

from hicache.codec import HEADER_SIZE, PageMeta
from hicache.errors import (
    InvalidArgumentError,
    PageKindMismatchError,
    PayloadChecksumError,
    TruncatedPageError,
)
from hicache.page_header import Codec, checked_body, pack_header, signature

__all__ = [
    "check_runs",
    "contiguous_runs",
    "encode_runs",
    "runs_checksum",
    "runs_within",
    "uint8_dtype",
]


def contiguous_runs(view: Any) -> list[memoryview]:
    """The bytes of a CPU tensor view as contiguous runs, in row-major order.

    Joined, the runs are ``view.flatten()``'s bytes; no byte is copied. The trailing dimensions
    that are laid out densely form one run, and every index over the leading ones is a run of
    its own (two runs that happen to touch are not merged: a host pool's page views never have
    such runs, and an extra segment costs little).
    """
    if view.device.type != "cpu":
        raise InvalidArgumentError(f"page runs need a CPU tensor, got one on {view.device}")
    if view.numel() == 0:
        return []
    rows = [view]
    for _ in range(_dense_suffix_start(tuple(view.shape), tuple(view.stride()))):
        rows = [sub for block in rows for sub in block.unbind(0)]
    # A dense row as 1-D with unit stride (a one-element row may carry any stride), then its
    # bytes through uint8 (numpy has no bfloat16).
    return [
        memoryview(row.as_strided((row.numel(),), (1,)).view(uint8_dtype()).numpy()) for row in rows
    ]


def runs_within(base: memoryview, base_address: int, view: Any) -> list[memoryview] | None:
    """:func:`contiguous_runs` of ``view`` as slices of ``base``, a flat byte view of the
    buffer the view lies in (a host pool's whole buffer) that starts at ``base_address``.

    The same runs, found with integer arithmetic instead of a tensor per run: a page of a
    ``layer_first`` pool is a run per layer and K/V. None when the view lies outside ``base``
    or has a negative stride (then use :func:`contiguous_runs`).
    """
    if view.numel() == 0:
        return []
    shape, stride = tuple(view.shape), tuple(view.stride())
    if min(stride, default=0) < 0:
        return None
    itemsize = int(view.element_size())
    start = int(view.data_ptr()) - base_address
    end = start + itemsize * (1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True)))
    if start < 0 or end > base.nbytes:
        return None
    lead = _dense_suffix_start(shape, stride)
    run = itemsize * math.prod(shape[lead:])
    offsets = [start]
    for dim in range(lead):  # row-major: each earlier dimension varies slower
        step = stride[dim] * itemsize
        offsets = [at + i * step for at in offsets for i in range(shape[dim])]
    return [base[at : at + run] for at in offsets]


def uint8_dtype() -> Any:
    import torch

    return torch.uint8


def _dense_suffix_start(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """The first dimension from which the view is dense (C-contiguous) to the end."""
    expected = 1
    start = len(shape)
    for dim in range(len(shape) - 1, -1, -1):
        if shape[dim] != 1 and stride[dim] != expected:
            break
        expected *= shape[dim]
        start = dim
    return start


def runs_checksum(runs: Sequence[memoryview]) -> int:
    """xxh3-64 of the runs joined, as the codec checksums a payload (streamed, no join)."""
    hasher = xxhash.xxh3_64()
    for run in runs:
        hasher.update(run)
    return hasher.intdigest()


def encode_runs(key: str, runs: Sequence[memoryview], meta: PageMeta) -> list[Any]:
    """The segments of the stored object for a page held as ``runs``: header first.

    The runs are not copied: keep them unchanged until the put has returned.
    """
    nbytes = sum(run.nbytes for run in runs)
    if nbytes != meta.nbytes:
        raise InvalidArgumentError(f"{key}: the page runs hold {nbytes} bytes, not {meta.nbytes}")
    checksum = runs_checksum(runs)
    header = pack_header(
        key, meta, Codec.NONE, list(runs), checksum, (meta.page_index, meta.parent_hash)
    )
    return [header, *runs]


def check_runs(
    key: str, header: memoryview, runs: Sequence[memoryview], nread: int, meta: PageMeta
) -> None:
    """Check an object a backend read as ``[header, *runs]`` for a page of kind ``meta``.

    Raises a :class:`~hicache.errors.CodecError` for anything that is not an uncompressed page
    of exactly this kind, key and length with a matching checksum: the reader counts a miss.
    """
    _, fields = checked_body(key, header)
    raw_len, payload_len, checksum, raw_checksum = fields[18:22]
    if nread < HEADER_SIZE + payload_len:
        raise TruncatedPageError(f"{key}: {nread} bytes, the header says more")
    if fields[6:10] + fields[11:17] != signature(meta) or raw_len != meta.nbytes:
        raise PageKindMismatchError(f"{key}: the stored page is of another kind")
    plain = fields[10] == Codec.NONE.value and payload_len == raw_len and checksum == raw_checksum
    if not plain or nread != HEADER_SIZE + payload_len:
        raise PageKindMismatchError(f"{key}: not an uncompressed page of {meta.nbytes} bytes")
    if runs_checksum(runs) != checksum:
        raise PayloadChecksumError(f"{key}: payload checksum mismatch")
