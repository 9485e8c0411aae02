"""The stored page format: a fixed 160-byte header followed by the payload.

Header (little-endian), version 1::

    0   4s  magic b"HCKV"            60  16s pool name (ASCII, NUL padded)
    4   H   format version           76  B   dtype code, B layout code, B ndim, B codec
    6   H   header size (160)        80  6I  shape (unused dims 0)
    8   I   flags (reserved, 0)      104 I   page index in its chain (0xFFFFFFFF: unknown)
    12  16s xxh3-128 of the key      108 Q   raw payload bytes
    28  32s parent page hash         116 Q   stored payload bytes
                                     124 Q   xxh3-64 of the stored payload
                                     132 Q   xxh3-64 of the raw payload
                                     140 12x reserved (zero)
                                     152 Q   xxh3-64 of bytes 0..152

The key digest makes a page copied or renamed under another key "foreign"; the parent hash lets
tools find orphans (a page whose predecessor is gone can never be hit). Anything that does not
check out raises a :class:`~hicache.errors.CodecError` subclass; callers turn that into a miss
and a counter, so a bad page never reaches a model.

Chains: a page stored under ``{ns16}-{fmt16}-{hash64}`` (see :mod:`hicache.keys`) records the
hash of the page before it as ``parent_hash``, so its parent's key is
``{ns16}-{fmt16}-{parent_hash.hex()}``, and its position as ``page_index``. The first page of a
chain has ``parent_hash == NO_PARENT`` (all zeros) and ``page_index`` 0. Pages under keys of
another shape (plugins, tests) are valid pages whose chain is unknown to tools.

Without compression, encode and decode touch no payload bytes except to checksum them: encode
returns ``[header, payload view]`` for a scatter-gather put, and decode checks a payload that a
backend read straight into the caller's buffer. With compression (``Codec.ZSTD_PLANES``) the
payload is split into byte planes (byte j of every element), and each plane is stored zstd-
compressed or raw, whichever is smaller; for bf16 KV the sign/exponent plane compresses well
and the mantissa plane is nearly random, so this is both faster and smaller than plain zstd.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hicache.dtypes import DType
from hicache.errors import (
    BadMagicError,
    CorruptHeaderError,
    ForeignPageError,
    InvalidArgumentError,
    PayloadChecksumError,
    TruncatedPageError,
    UnsupportedVersionError,
)
from hicache.layouts.kinds import Layout

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAX_PAYLOAD_BYTES",
    "NO_PARENT",
    "check_into",
    "Codec",
    "PageHeader",
    "PageMeta",
    "check_page",
    "decode_into",
    "decode_page",
    "encode_page",
    "key_digest",
    "parse_header",
    "verify_page",
]

MAGIC = b"HCKV"
FORMAT_VERSION = 1
HEADER_SIZE = 160
MAX_NDIM = 6
MAX_PAYLOAD_BYTES = 1 << 34  # 16 GiB: anything larger is a corrupt length, not a page
NO_PARENT = bytes(32)
_UNKNOWN_INDEX = 0xFFFFFFFF
_BODY = struct.Struct("<4sHHI16s32s16sBBBB6IIQQQQ12x")
_CHECK = struct.Struct("<Q")
# Where the meta fields (pool to shape), the page index and the checksums start in a header.
_POOL_AT = struct.calcsize("<4sHHI16s32s")
_INDEX_AT = struct.calcsize("<4sHHI16s32s16sBBBB6I")
_CHECKSUMS_AT = struct.calcsize("<4sHHI16s32s16sBBBB6IIQQ")
# Meta fields and lengths (the bytes from _POOL_AT to _CHECKSUMS_AT, less the page index) that
# verify_page found valid; any set that passed once passes again.
_GOOD_SHAPES: set[bytes] = set()
_PLANE_ENTRY = struct.Struct("<BQ")  # per byte plane: stored raw (0) or zstd (1), stored length
assert _BODY.size + _CHECK.size == HEADER_SIZE


# Fast zstd parameters for KV planes: their redundancy is in symbol frequencies, not repeats, so
# a tiny match finder with long minimum matches leaves nearly all work to the entropy coder.
# zstandard is imported on first use: reading and writing uncompressed pages needs no zstd.
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


class Codec(enum.Enum):
    """How the payload is stored."""

    NONE = 0
    ZSTD_PLANES = 1


# On-disk codes to members, for parse_header: a dict lookup instead of a loop per header.
_DTYPE_OF = {member.code: member for member in DType}
_LAYOUT_OF = {member.code: member for member in Layout}
_CODEC_OF = {member.value: member for member in Codec}


@dataclass(frozen=True, slots=True)
class PageMeta:
    """What a page holds; a reader passes the meta it expects, and any difference is foreign."""

    pool: str
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout = Layout.RAW
    page_index: int | None = None
    parent_hash: bytes = NO_PARENT

    def __post_init__(self) -> None:
        raw_pool = self.pool.encode("ascii", "replace") if isinstance(self.pool, str) else b""
        if not raw_pool or len(raw_pool) > 16 or not self.pool.isascii():
            raise InvalidArgumentError(f"pool must be 1-16 ASCII characters, got {self.pool!r}")
        if not isinstance(self.dtype, DType) or not isinstance(self.layout, Layout):
            raise InvalidArgumentError("dtype must be a DType and layout a Layout")
        if len(self.shape) > MAX_NDIM or any(
            not isinstance(d, int) or d < 0 or d > 0xFFFFFFFF for d in self.shape
        ):
            raise InvalidArgumentError(f"shape must have at most {MAX_NDIM} dims in [0, 2**32)")
        if self.page_index is not None and not 0 <= self.page_index < _UNKNOWN_INDEX:
            raise InvalidArgumentError(f"page_index out of range: {self.page_index}")
        if len(self.parent_hash) != 32:
            raise InvalidArgumentError("parent_hash must be 32 bytes")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def same_content_as(self, other: PageMeta) -> bool:
        """Same pool, dtype, shape and layout: the fields that decide how bytes are read."""
        return (self.pool, self.dtype, self.shape, self.layout) == (
            other.pool,
            other.dtype,
            other.shape,
            other.layout,
        )


@dataclass(frozen=True, slots=True)
class PageHeader:
    """A parsed, checked header."""

    meta: PageMeta
    codec: Codec
    key_digest: bytes
    raw_len: int
    payload_len: int
    payload_checksum: int  # of the stored bytes: verifiable without decompressing
    raw_checksum: int  # of the decoded bytes: what the model gets

    @property
    def object_len(self) -> int:
        return HEADER_SIZE + self.payload_len


_META_FIELDS = ("pool", "dtype", "shape", "layout", "page_index", "parent_hash")


def meta_at(template: PageMeta, page_index: int | None, parent_hash: bytes) -> PageMeta:
    """``template`` at another place in a chain, checking only the two fields that differ.

    For a reader or writer that builds one meta per page: the template was checked once.
    """
    if page_index is not None and not 0 <= page_index < _UNKNOWN_INDEX:
        raise InvalidArgumentError(f"page_index out of range: {page_index}")
    if len(parent_hash) != 32:
        raise InvalidArgumentError("parent_hash must be 32 bytes")
    meta = object.__new__(PageMeta)
    values = (template.pool, template.dtype, template.shape, template.layout)
    for name, value in zip(_META_FIELDS, (*values, page_index, parent_hash), strict=True):
        object.__setattr__(meta, name, value)
    return meta


def _signature(meta: PageMeta) -> tuple[Any, ...]:
    """The header fields that say what a page holds (pool to shape, without the codec)."""
    # Enum members are singletons: their ids key the cache without hashing the enums.
    cache_key = (meta.pool, meta.shape, id(meta.dtype), id(meta.layout))
    sig = _SIGNATURES.get(cache_key)
    if sig is None:
        shape = tuple(meta.shape) + (0,) * (MAX_NDIM - len(meta.shape))
        pool = meta.pool.encode("ascii").ljust(16, b"\x00")
        sig = (pool, meta.dtype.code, meta.layout.code, len(meta.shape), *shape)
        if len(_SIGNATURES) >= 256:
            _SIGNATURES.clear()
        _SIGNATURES[cache_key] = sig
    return sig


_SIGNATURES: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def key_digest(key: str) -> bytes:
    return xxhash.xxh3_128_digest(key.encode("utf-8"))


def _flat(payload: object) -> memoryview:
    view = memoryview(payload)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise InvalidArgumentError("page payloads must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _pack_header(
    key: str,
    meta: PageMeta,
    codec: Codec,
    payload: Sequence[memoryview],
    raw_checksum: int,
    place: tuple[int | None, bytes],
) -> bytes:
    if codec is Codec.NONE:
        stored_checksum = raw_checksum
    else:
        hasher = xxhash.xxh3_64()
        for part in payload:
            hasher.update(part)
        stored_checksum = hasher.intdigest()
    sig = _signature(meta)  # pool, dtype, layout, ndim, shape: packed once per kind of page
    index, parent_hash = place
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        0,
        key_digest(key),
        parent_hash,
        *sig[:4],
        codec.value,
        *sig[4:],
        _UNKNOWN_INDEX if index is None else index,
        meta.nbytes,
        sum(p.nbytes for p in payload),
        stored_checksum,
        raw_checksum,
    )
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def encode_page(
    key: str,
    payload: object,
    meta: PageMeta,
    compress: bool = False,
    place: tuple[int | None, bytes] | None = None,
) -> list[bytes | memoryview]:
    """The segments of the stored object, header first, ready for ``backend.put``.

    Uncompressed, the payload segment is a view of the caller's buffer (no copy): keep the
    buffer unchanged until the put has returned. Compression falls back to storing the payload
    as is when it would not shrink. ``place``: (page index, parent hash) overriding ``meta``'s,
    for a writer that keeps one meta per pool.
    """
    if place is None:
        place = (meta.page_index, meta.parent_hash)
    elif (place[0] is not None and not 0 <= place[0] < _UNKNOWN_INDEX) or len(place[1]) != 32:
        raise InvalidArgumentError(
            f"bad page place: index {place[0]}, a {len(place[1])}-byte parent"
        )
    view = _flat(payload)
    if view.nbytes != meta.nbytes:
        raise InvalidArgumentError(
            f"payload is {view.nbytes} bytes but {meta.dtype.label}{list(meta.shape)} "
            f"needs {meta.nbytes}"
        )
    raw_checksum = xxhash.xxh3_64_intdigest(view)
    if compress and view.nbytes:
        parts = _compress_planes(view, meta.dtype.itemsize)
        if parts is not None:
            header = _pack_header(key, meta, Codec.ZSTD_PLANES, parts, raw_checksum, place)
            return [header, *parts]
    return [_pack_header(key, meta, Codec.NONE, [view], raw_checksum, place), view]


def parse_header(key: str, header: object) -> PageHeader:
    """Check and parse a header; raises a :class:`CodecError` subclass when it is not right."""
    return _header_of(key, _checked_body(key, _flat(header))[1])


def _checked_body(key: str, raw: memoryview) -> tuple[bytes, tuple[Any, ...]]:
    """The header's bytes and fields once its magic, version, checksum and key are right."""
    if raw.nbytes < HEADER_SIZE:
        raise TruncatedPageError(f"{key}: {raw.nbytes} bytes, shorter than a page header")
    # One small copy: checks on bytes are much cheaper than on memoryview slices, and verify
    # parses a header per object.
    head = raw[:HEADER_SIZE].tobytes()
    if head[:4] != MAGIC:
        raise BadMagicError(f"{key}: not a hicache page (bad magic)")
    fields = _BODY.unpack_from(head)
    if fields[1] != FORMAT_VERSION:
        raise UnsupportedVersionError(f"{key}: page format version {fields[1]} is not supported")
    if xxhash.xxh3_64_intdigest(head[: _BODY.size]) != _CHECK.unpack_from(head, _BODY.size)[0]:
        raise CorruptHeaderError(f"{key}: header checksum mismatch")
    if fields[4] != key_digest(key):
        raise ForeignPageError(f"{key}: the page was written under another key")
    return head, fields


def _header_of(
    key: str, fields: tuple[Any, ...], parsed: tuple[PageMeta, Codec] | None = None
) -> PageHeader:
    """The header of checked body fields, once its meta and lengths are consistent."""
    meta, codec = parsed or _meta_of(key, fields)
    raw_len, payload_len, checksum, raw_checksum = fields[18:22]
    limit = raw_len if codec is Codec.NONE else raw_len + 16 * meta.dtype.itemsize + 64
    if raw_len != meta.nbytes or payload_len > limit or payload_len > MAX_PAYLOAD_BYTES:
        raise CorruptHeaderError(f"{key}: inconsistent lengths (raw {raw_len}, {payload_len})")
    _check_codec_checksums(key, codec.value, checksum, raw_checksum)
    return PageHeader(meta, codec, fields[4], raw_len, payload_len, checksum, raw_checksum)


def _expected_header(key: str, fields: tuple[Any, ...], expect: PageMeta) -> PageHeader:
    """The header of checked fields whose meta equals ``expect``'s (only the place differs)."""
    index = fields[17]
    meta = meta_at(expect, None if index == _UNKNOWN_INDEX else index, fields[5])
    try:
        codec = _CODEC_OF.get(fields[10]) or Codec(fields[10])
    except ValueError as exc:
        raise CorruptHeaderError(f"{key}: bad header field: {exc}") from None
    return _header_of(key, fields, (meta, codec))


def _check_codec_checksums(key: str, codec: int, checksum: int, raw_checksum: int) -> None:
    if codec == Codec.NONE.value and checksum != raw_checksum:
        raise CorruptHeaderError(f"{key}: an uncompressed page with two different checksums")


def _meta_of(key: str, fields: tuple[Any, ...]) -> tuple[PageMeta, Codec]:
    """The page meta and codec of an unpacked header body; CorruptHeaderError when invalid."""
    ndim, index = fields[9], fields[17]
    try:
        # A known code is one dict lookup; an unknown one takes the slow path for its error.
        meta = PageMeta(
            pool=fields[6].rstrip(b"\x00").decode("ascii"),
            dtype=_DTYPE_OF.get(fields[7]) or DType.from_code(fields[7]),
            shape=fields[11 : 11 + min(ndim, MAX_NDIM)],
            layout=_LAYOUT_OF.get(fields[8]) or Layout.from_code(fields[8]),
            page_index=None if index == _UNKNOWN_INDEX else index,
            parent_hash=fields[5],
        )
        codec = _CODEC_OF.get(fields[10]) or Codec(fields[10])
    except (ValueError, InvalidArgumentError, UnicodeDecodeError) as exc:
        raise CorruptHeaderError(f"{key}: bad header field: {exc}") from None
    return meta, codec


def _check_expected(key: str, header: PageHeader, expect: PageMeta | None) -> None:
    if expect is not None and not header.meta.same_content_as(expect):
        got = header.meta
        raise ForeignPageError(
            f"{key}: holds {got.pool} {got.dtype.label}{list(got.shape)} {got.layout.label}, "
            f"expected {expect.pool} {expect.dtype.label}{list(expect.shape)} {expect.layout.label}"
        )


def decode_into(
    key: str,
    header_buf: object,
    payload_buf: object,
    nread: int,
    expect: PageMeta | None = None,
) -> PageHeader:
    """Check an object a backend read as ``[header_buf, payload_buf]`` and leave the raw
    payload in ``payload_buf``. ``nread`` is what ``get_into`` returned for it.
    """
    _, fields = _checked_body(key, _flat(header_buf))
    if expect is not None and fields[6:10] + fields[11:17] == _signature(expect):
        header = _expected_header(key, fields, expect)  # the usual case: no meta to rebuild
    else:
        header = _header_of(key, fields)
        _check_expected(key, header, expect)
    dest = _flat(payload_buf)
    if nread < header.object_len:
        raise TruncatedPageError(f"{key}: {nread} bytes, the header says {header.object_len}")
    if nread > header.object_len:
        raise CorruptHeaderError(f"{key}: {nread} bytes, the header says {header.object_len}")
    if header.raw_len > dest.nbytes or header.payload_len > dest.nbytes:
        raise InvalidArgumentError(f"{key}: the payload buffer holds {dest.nbytes} bytes")
    stored = dest[: header.payload_len]
    if xxhash.xxh3_64_intdigest(stored) != header.payload_checksum:
        raise PayloadChecksumError(f"{key}: payload checksum mismatch")
    if header.codec is Codec.ZSTD_PLANES:
        raw = dest[: header.raw_len]
        _decompress_planes(key, bytes(stored), raw, header.meta.dtype.itemsize)
        _check_raw(key, header, raw)
    return header


def check_into(
    key: str, header_buf: object, payload_buf: object, nread: int, expect: PageMeta
) -> None:
    """:func:`decode_into` for a reader that needs no header back: the same checks and errors.

    An uncompressed page of the expected kind is checked without building its header (the
    common case, per page of every L3 read); anything else goes through :func:`decode_into`.
    """
    _, fields = _checked_body(key, _flat(header_buf))
    raw_len, payload_len, checksum, raw_checksum = fields[18:22]
    plain = (
        fields[10] == Codec.NONE.value
        and raw_len == payload_len == expect.nbytes
        and checksum == raw_checksum
        and nread == HEADER_SIZE + payload_len
        and fields[6:10] + fields[11:17] == _signature(expect)
    )
    dest = _flat(payload_buf)
    if plain and dest.nbytes >= payload_len:
        if xxhash.xxh3_64_intdigest(dest[:payload_len]) != checksum:
            raise PayloadChecksumError(f"{key}: payload checksum mismatch")
        return
    decode_into(key, header_buf, payload_buf, nread, expect)


def check_page(key: str, data: object) -> PageHeader:
    """Check a whole stored object (header, length, stored-payload checksum) without decoding.

    What ``hicache verify`` needs: a compressed page is checked without decompressing it.
    """
    raw = _flat(data)
    header = parse_header(key, raw)
    _check_stored(key, raw, header.object_len, header.payload_checksum)
    return header


def verify_page(key: str, data: object) -> None:
    """:func:`check_page` without building the header: the same checks, the same errors.

    For tools that read a whole store. Pages of one store share a few shapes, so the meta
    fields and lengths are checked once per distinct value (remembered, bounded) instead of once
    per page; what differs per page (key, parent, index, checksums) is checked every time.
    """
    raw = _flat(data)
    head, fields = _checked_body(key, raw)
    shape = head[_POOL_AT:_INDEX_AT] + head[_INDEX_AT + 4 : _CHECKSUMS_AT]
    if shape in _GOOD_SHAPES:
        _check_codec_checksums(key, fields[10], fields[20], fields[21])
    else:
        _header_of(key, fields)
        if len(_GOOD_SHAPES) >= 4096:
            _GOOD_SHAPES.clear()
        _GOOD_SHAPES.add(shape)
    _check_stored(key, raw, HEADER_SIZE + fields[19], fields[20])


def _check_stored(key: str, raw: memoryview, object_len: int, checksum: int) -> memoryview:
    """The stored payload of a whole object, once its length and checksum are right."""
    if raw.nbytes < object_len:
        raise TruncatedPageError(f"{key}: {raw.nbytes} bytes, the header says {object_len}")
    if raw.nbytes > object_len:
        raise CorruptHeaderError(f"{key}: {raw.nbytes} bytes, the header says {object_len}")
    stored = raw[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(stored) != checksum:
        raise PayloadChecksumError(f"{key}: payload checksum mismatch")
    return stored


def decode_page(
    key: str, data: object, expect: PageMeta | None = None
) -> tuple[PageHeader, memoryview]:
    """Check a whole object held in one buffer; returns the header and the raw payload."""
    raw = _flat(data)
    header = parse_header(key, raw)
    _check_expected(key, header, expect)
    stored = _check_stored(key, raw, header.object_len, header.payload_checksum)
    if header.codec is Codec.NONE:
        return header, stored
    out = memoryview(bytearray(header.raw_len))
    _decompress_planes(key, bytes(stored), out, header.meta.dtype.itemsize)
    _check_raw(key, header, out)
    return header, out


def _check_raw(key: str, header: PageHeader, raw: memoryview) -> None:
    if xxhash.xxh3_64_intdigest(raw) != header.raw_checksum:
        raise PayloadChecksumError(f"{key}: decoded payload checksum mismatch")


def _compress_planes(view: memoryview, itemsize: int) -> list[memoryview] | None:
    """A plane table and the byte planes, each zstd-compressed where that pays.

    Returned as segments, so nothing is joined: the backend writes them back to back. None when
    the result would not be smaller than the payload.
    """
    if view.nbytes % itemsize:
        return None
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


def _decompress_planes(key: str, stored: bytes, dest: memoryview, itemsize: int) -> None:
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
