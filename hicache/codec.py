"""Encoding and decoding stored pages: a 160-byte header (:mod:`hicache.page_header`) followed
by the payload.

Anything that does not check out raises a :class:`~hicache.errors.CodecError` subclass; callers
turn that into a miss and a counter, so a bad page never reaches a model.
Without compression, encode and decode touch no payload bytes except to checksum them: encode
returns ``[header, payload view]`` for a scatter-gather put, and decode checks a payload that a
backend read straight into the caller's buffer. With compression (``Codec.ZSTD_PLANES``,
:mod:`hicache.byte_planes`) the payload is stored as byte planes, each zstd-compressed or raw.
"""

from __future__ import annotations

import xxhash

from hicache.byte_planes import compress_planes, decompress_planes
from hicache.errors import (
    CorruptHeaderError,
    InvalidArgumentError,
    PayloadChecksumError,
    TruncatedPageError,
)
from hicache.page_header import (
    CHECKSUMS_AT,
    FORMAT_VERSION,
    HEADER_SIZE,
    INDEX_AT,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    NO_PARENT,
    POOL_AT,
    UNKNOWN_INDEX,
    Codec,
    PageHeader,
    PageMeta,
    check_codec_checksums,
    check_expected,
    checked_body,
    expected_header,
    flat_bytes,
    header_of,
    key_digest,
    meta_at,
    pack_header,
    parse_header,
    signature,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_PAYLOAD_BYTES",
    "NO_PARENT",
    "check_into",
    "Codec",
    "PageHeader",
    "PageMeta",
    "check_page",
    "payload_checked_by",
    "decode_into",
    "decode_page",
    "encode_page",
    "key_digest",
    "meta_at",
    "parse_header",
    "verify_page",
]

# Meta fields and lengths (the bytes from POOL_AT to CHECKSUMS_AT, less the page index) that
# verify_page found valid; any set that passed once passes again.
_GOOD_SHAPES: set[bytes] = set()


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
    elif (place[0] is not None and not 0 <= place[0] < UNKNOWN_INDEX) or len(place[1]) != 32:
        raise InvalidArgumentError(
            f"bad page place: index {place[0]}, a {len(place[1])}-byte parent"
        )
    view = flat_bytes(payload)
    if view.nbytes != meta.nbytes:
        raise InvalidArgumentError(
            f"payload is {view.nbytes} bytes but {meta.dtype.label}{list(meta.shape)} "
            f"needs {meta.nbytes}"
        )
    raw_checksum = xxhash.xxh3_64_intdigest(view)
    if compress and view.nbytes:
        parts = compress_planes(view, meta.dtype.itemsize)
        if parts is not None:
            header = pack_header(key, meta, Codec.ZSTD_PLANES, parts, raw_checksum, place)
            return [header, *parts]
    return [pack_header(key, meta, Codec.NONE, [view], raw_checksum, place), view]


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
    _, fields = checked_body(key, flat_bytes(header_buf))
    if expect is not None and fields[6:10] + fields[11:17] == signature(expect):
        header = expected_header(key, fields, expect)  # the usual case: no meta to rebuild
    else:
        header = header_of(key, fields)
        check_expected(key, header, expect)
    dest = flat_bytes(payload_buf)
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
        decompress_planes(key, bytes(stored), raw, header.meta.dtype.itemsize)
        _check_raw(key, header, raw)
    return header


def check_into(
    key: str,
    header_buf: object,
    payload_buf: object,
    nread: int,
    expect: PageMeta,
    payload_checked: bool = False,
) -> None:
    """:func:`decode_into` for a reader that needs no header back: the same checks and errors.

    An uncompressed page of the expected kind is checked without building its header (the
    common case, per page of every L3 read); anything else goes through :func:`decode_into`.
    ``payload_checked``: the backend checked this page's stored payload against the checksum
    in this header as it read it (:func:`payload_checked_by`), so it is not hashed again; the
    header, key, kind and lengths are checked all the same.
    """
    _, fields = checked_body(key, flat_bytes(header_buf))
    raw_len, payload_len, checksum, raw_checksum = fields[18:22]
    plain = (
        fields[10] == Codec.NONE.value
        and raw_len == payload_len == expect.nbytes
        and checksum == raw_checksum
        and nread == HEADER_SIZE + payload_len
        and fields[6:10] + fields[11:17] == signature(expect)
    )
    dest = flat_bytes(payload_buf)
    if plain and dest.nbytes >= payload_len:
        if not payload_checked and xxhash.xxh3_64_intdigest(dest[:payload_len]) != checksum:
            raise PayloadChecksumError(f"{key}: payload checksum mismatch")
        return
    decode_into(key, header_buf, payload_buf, nread, expect)


def payload_checked_by(checks_pages_over: int | None, nread: int) -> bool:
    """Whether a backend whose ``Capabilities.checks_pages_over`` is ``checks_pages_over``
    checked the page checksum of an object of ``nread`` bytes it returned."""
    return checks_pages_over is not None and nread > checks_pages_over


def check_page(key: str, data: object) -> PageHeader:
    """Check a whole stored object (header, length, stored-payload checksum) without decoding.

    What ``hicache verify`` needs: a compressed page is checked without decompressing it.
    """
    raw = flat_bytes(data)
    header = parse_header(key, raw)
    _check_stored(key, raw, header.object_len, header.payload_checksum)
    return header


def verify_page(key: str, data: object) -> None:
    """:func:`check_page` without building the header: the same checks, the same errors.

    For tools that read a whole store. Pages of one store share a few shapes, so the meta
    fields and lengths are checked once per distinct value (remembered, bounded) instead of once
    per page; what differs per page (key, parent, index, checksums) is checked every time.
    """
    raw = flat_bytes(data)
    head, fields = checked_body(key, raw)
    shape = head[POOL_AT:INDEX_AT] + head[INDEX_AT + 4 : CHECKSUMS_AT]
    if shape in _GOOD_SHAPES:
        check_codec_checksums(key, fields[10], fields[20], fields[21])
    else:
        header_of(key, fields)
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
    raw = flat_bytes(data)
    header = parse_header(key, raw)
    check_expected(key, header, expect)
    stored = _check_stored(key, raw, header.object_len, header.payload_checksum)
    if header.codec is Codec.NONE:
        return header, stored
    out = memoryview(bytearray(header.raw_len))
    decompress_planes(key, bytes(stored), out, header.meta.dtype.itemsize)
    _check_raw(key, header, out)
    return header, out


def _check_raw(key: str, header: PageHeader, raw: memoryview) -> None:
    if xxhash.xxh3_64_intdigest(raw) != header.raw_checksum:
        raise PayloadChecksumError(f"{key}: decoded payload checksum mismatch")
