"""The stored page's 160-byte header: its layout, packing, parsing and checks.

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
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from hicache.dtypes import DType, Layout
from hicache.errors import (
    BadMagicError,
    CorruptHeaderError,
    ForeignPageError,
    InvalidArgumentError,
    PageKindMismatchError,
    TruncatedPageError,
    UnsupportedVersionError,
)

__all__ = [
    "CHECKSUMS_AT",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "INDEX_AT",
    "MAGIC",
    "MAX_NDIM",
    "MAX_PAYLOAD_BYTES",
    "NO_PARENT",
    "POOL_AT",
    "UNKNOWN_INDEX",
    "Codec",
    "PageHeader",
    "PageMeta",
    "check_codec_checksums",
    "check_expected",
    "checked_body",
    "expected_header",
    "flat_bytes",
    "header_of",
    "key_digest",
    "meta_at",
    "meta_of",
    "pack_header",
    "parse_header",
    "signature",
    "stored_payload_checksum",
]

MAGIC = b"HCKV"
FORMAT_VERSION = 1
HEADER_SIZE = 160
MAX_NDIM = 6
MAX_PAYLOAD_BYTES = 1 << 34  # 16 GiB: anything larger is a corrupt length, not a page
NO_PARENT = bytes(32)
UNKNOWN_INDEX = 0xFFFFFFFF
BODY = struct.Struct("<4sHHI16s32s16sBBBB6IIQQQQ12x")
CHECK = struct.Struct("<Q")
VERSION = struct.Struct("<H")  # the format version field, at offset 4
# Where the meta fields (pool to shape), the page index and the checksums start in a header.
POOL_AT = struct.calcsize("<4sHHI16s32s")
INDEX_AT = struct.calcsize("<4sHHI16s32s16sBBBB6I")
CHECKSUMS_AT = struct.calcsize("<4sHHI16s32s16sBBBB6IIQQ")
assert BODY.size + CHECK.size == HEADER_SIZE


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
        if self.page_index is not None and not 0 <= self.page_index < UNKNOWN_INDEX:
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
    if page_index is not None and not 0 <= page_index < UNKNOWN_INDEX:
        raise InvalidArgumentError(f"page_index out of range: {page_index}")
    if len(parent_hash) != 32:
        raise InvalidArgumentError("parent_hash must be 32 bytes")
    meta = object.__new__(PageMeta)
    values = (template.pool, template.dtype, template.shape, template.layout)
    for name, value in zip(_META_FIELDS, (*values, page_index, parent_hash), strict=True):
        object.__setattr__(meta, name, value)
    return meta


def signature(meta: PageMeta) -> tuple[Any, ...]:
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


def flat_bytes(payload: object) -> memoryview:
    view = memoryview(payload)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise InvalidArgumentError("page payloads must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def pack_header(
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
    sig = signature(meta)  # pool, dtype, layout, ndim, shape: packed once per kind of page
    index, parent_hash = place
    body = BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        0,
        key_digest(key),
        parent_hash,
        *sig[:4],
        codec.value,
        *sig[4:],
        UNKNOWN_INDEX if index is None else index,
        meta.nbytes,
        sum(p.nbytes for p in payload),
        stored_checksum,
        raw_checksum,
    )
    return body + CHECK.pack(xxhash.xxh3_64_intdigest(body))


def stored_payload_checksum(head: memoryview, object_len: int) -> int | None:
    """The stored payload's xxh3-64 that the page header at the start of ``head`` gives, when
    it is a well-formed header (magic, version, its own checksum) of an object of
    ``object_len`` bytes; None otherwise. Blind to the key: for a store that checks a page's
    payload where its bytes pass (``disk://``); the reader still checks the rest."""
    if head.nbytes < HEADER_SIZE:
        return None
    raw = head[:HEADER_SIZE].tobytes()
    if raw[:4] != MAGIC:
        return None
    fields = BODY.unpack_from(raw)
    if fields[1] != FORMAT_VERSION or HEADER_SIZE + fields[19] != object_len:
        return None
    if xxhash.xxh3_64_intdigest(raw[: BODY.size]) != CHECK.unpack_from(raw, BODY.size)[0]:
        return None
    return int(fields[20])


def parse_header(key: str, header: object) -> PageHeader:
    """Check and parse a header; raises a :class:`CodecError` subclass when it is not right."""
    return header_of(key, checked_body(key, flat_bytes(header))[1])


def checked_body(key: str, raw: memoryview) -> tuple[bytes, tuple[Any, ...]]:
    """The header's bytes and fields once its magic, version, checksum and key are right."""
    if raw.nbytes < HEADER_SIZE:
        raise TruncatedPageError(f"{key}: {raw.nbytes} bytes, shorter than a page header")
    # One small copy: checks on bytes are much cheaper than on memoryview slices, and verify
    # parses a header per object.
    head = raw[:HEADER_SIZE].tobytes()
    if head[:4] != MAGIC:
        raise BadMagicError(f"{key}: not a hicache page (bad magic)")
    fields = BODY.unpack_from(head)
    stored = CHECK.unpack_from(head, BODY.size)[0]
    if fields[1] != FORMAT_VERSION:
        # A damaged version field must not pass for a newer writer's page (which tools keep):
        # with this version restored the header checks out, so only the version was hit.
        restored = head[:4] + VERSION.pack(FORMAT_VERSION) + head[6 : BODY.size]
        if xxhash.xxh3_64_intdigest(restored) == stored:
            raise CorruptHeaderError(f"{key}: damaged format version field ({fields[1]})")
        raise UnsupportedVersionError(f"{key}: page format version {fields[1]} is not supported")
    if xxhash.xxh3_64_intdigest(head[: BODY.size]) != stored:
        raise CorruptHeaderError(f"{key}: header checksum mismatch")
    if fields[4] != key_digest(key):
        raise ForeignPageError(f"{key}: the page was written under another key")
    return head, fields


def header_of(
    key: str, fields: tuple[Any, ...], parsed: tuple[PageMeta, Codec] | None = None
) -> PageHeader:
    """The header of checked body fields, once its meta and lengths are consistent."""
    meta, codec = parsed or meta_of(key, fields)
    raw_len, payload_len, checksum, raw_checksum = fields[18:22]
    limit = raw_len if codec is Codec.NONE else raw_len + 16 * meta.dtype.itemsize + 64
    if raw_len != meta.nbytes or payload_len > limit or payload_len > MAX_PAYLOAD_BYTES:
        raise CorruptHeaderError(f"{key}: inconsistent lengths (raw {raw_len}, {payload_len})")
    check_codec_checksums(key, codec.value, checksum, raw_checksum)
    return PageHeader(meta, codec, fields[4], raw_len, payload_len, checksum, raw_checksum)


def expected_header(key: str, fields: tuple[Any, ...], expect: PageMeta) -> PageHeader:
    """The header of checked fields whose meta equals ``expect``'s (only the place differs)."""
    index = fields[17]
    meta = meta_at(expect, None if index == UNKNOWN_INDEX else index, fields[5])
    try:
        codec = _CODEC_OF.get(fields[10]) or Codec(fields[10])
    except ValueError as exc:
        raise CorruptHeaderError(f"{key}: bad header field: {exc}") from None
    return header_of(key, fields, (meta, codec))


def check_codec_checksums(key: str, codec: int, checksum: int, raw_checksum: int) -> None:
    if codec == Codec.NONE.value and checksum != raw_checksum:
        raise CorruptHeaderError(f"{key}: an uncompressed page with two different checksums")


def meta_of(key: str, fields: tuple[Any, ...]) -> tuple[PageMeta, Codec]:
    """The page meta and codec of an unpacked header body; CorruptHeaderError when invalid."""
    ndim, index = fields[9], fields[17]
    try:
        # A known code is one dict lookup; an unknown one takes the slow path for its error.
        meta = PageMeta(
            pool=fields[6].rstrip(b"\x00").decode("ascii"),
            dtype=_DTYPE_OF.get(fields[7]) or DType.from_code(fields[7]),
            shape=fields[11 : 11 + min(ndim, MAX_NDIM)],
            layout=_LAYOUT_OF.get(fields[8]) or Layout.from_code(fields[8]),
            page_index=None if index == UNKNOWN_INDEX else index,
            parent_hash=fields[5],
        )
        codec = _CODEC_OF.get(fields[10]) or Codec(fields[10])
    except (ValueError, InvalidArgumentError, UnicodeDecodeError) as exc:
        raise CorruptHeaderError(f"{key}: bad header field: {exc}") from None
    return meta, codec


def check_expected(key: str, header: PageHeader, expect: PageMeta | None) -> None:
    if expect is not None and not header.meta.same_content_as(expect):
        got = header.meta
        raise PageKindMismatchError(
            f"{key}: holds {got.pool} {got.dtype.label}{list(got.shape)} {got.layout.label}, "
            f"expected {expect.pool} {expect.dtype.label}{list(expect.shape)} {expect.layout.label}"
        )
