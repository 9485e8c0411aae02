"""Byte-plane compression of a page payload (the codec's ``ZSTD_PLANES``).

The payload is split into byte planes (byte j of every element), and each plane is stored
zstd-compressed or raw, whichever is smaller, after a plane table. For bf16 KV the sign and
exponent plane compresses well and the mantissa plane is nearly random, so this is both faster
and smaller than plain zstd over the whole payload.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

from hicache.errors import CorruptHeaderError

__all__ = ["compress_planes", "decompress_planes"]

_PLANE_ENTRY = struct.Struct("<BQ")  # per byte plane: stored raw (0) or zstd (1), stored length


# Fast zstd parameters for KV planes: their redundancy is in symbol frequencies, not repeats, so
# a tiny match finder with long minimum matches leaves nearly all work to the entropy coder.
# zstandard (and numpy, for the byte planes) is imported on first use: reading and writing
# uncompressed pages needs neither, and the store tools start faster without them.
@functools.cache
def _zstd() -> tuple[Any, Any]:
    import zstandard

    params = zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST,
        window_log=17,
        hash_log=10,
        chain_log=10,
        search_log=1,
        min_match=7,
        target_length=0,
    )
    return zstandard, params


_SAMPLE_BYTES = 8192
_MIN_GAIN = 0.95  # compress a plane only when a sample shrinks below 95 %


def compress_planes(view: memoryview, itemsize: int) -> list[memoryview] | None:
    """A plane table and the byte planes, each zstd-compressed where that pays.

    Returned as segments, so nothing is joined: the backend writes them back to back. None when
    the result would not be smaller than the payload.
    """
    if view.nbytes % itemsize:
        return None
    import numpy as np

    flat = np.frombuffer(view, dtype=np.uint8)
    planes = flat.reshape(-1, itemsize).T.copy() if itemsize > 1 else flat.reshape(1, -1)
    zstandard, params = _zstd()
    compressor = zstandard.ZstdCompressor(compression_params=params)
    table = bytearray()
    parts: list[memoryview] = [memoryview(b"")]  # the table, once complete
    for plane_array in planes:
        plane = memoryview(plane_array.data)
        # A sample tells cheaply whether a plane is worth compressing: mantissa planes of
        # floating-point KV are close to random and would cost time for nothing.
        squeezed: bytes | None = None
        sample = plane[:_SAMPLE_BYTES]
        if len(compressor.compress(sample)) < _MIN_GAIN * sample.nbytes:
            squeezed = compressor.compress(plane)
        if squeezed is not None and len(squeezed) < plane.nbytes:
            table += _PLANE_ENTRY.pack(1, len(squeezed))
            parts.append(memoryview(squeezed))
        else:
            table += _PLANE_ENTRY.pack(0, plane.nbytes)
            parts.append(plane)
    parts[0] = memoryview(bytes(table))
    if sum(p.nbytes for p in parts) >= view.nbytes:
        return None
    return parts


def decompress_planes(key: str, stored: bytes, dest: memoryview, itemsize: int) -> None:
    import numpy as np

    n_elems = dest.nbytes // itemsize
    out = np.frombuffer(dest, dtype=np.uint8)
    if itemsize > 1:
        out = out.reshape(n_elems, itemsize)
    zstandard, _ = _zstd()
    decompressor = zstandard.ZstdDecompressor()
    offset = _PLANE_ENTRY.size * itemsize
    try:
        for j in range(itemsize):
            mode, length = _PLANE_ENTRY.unpack_from(stored, j * _PLANE_ENTRY.size)
            part = stored[offset : offset + length]
            offset += length
            if mode == 1:
                part = decompressor.decompress(part, max_output_size=n_elems)
            if len(part) != n_elems or mode not in (0, 1):
                raise CorruptHeaderError(f"{key}: byte plane {j} has the wrong size")
            plane = np.frombuffer(part, dtype=np.uint8)
            if itemsize > 1:
                out[:, j] = plane
            else:
                out[:] = plane
    except (zstandard.ZstdError, struct.error) as exc:
        raise CorruptHeaderError(f"{key}: compressed payload does not decode: {exc}") from None
    if offset != len(stored):
        raise CorruptHeaderError(f"{key}: compressed payload has trailing bytes")
