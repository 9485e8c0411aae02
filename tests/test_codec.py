"""The page codec: round trips, zero-copy paths, and every way a stored object can be wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.codec import (
    HEADER_SIZE,
    NO_PARENT,
    Codec,
    PageMeta,
    check_into,
    decode_into,
    decode_page,
    encode_page,
    parse_header,
    verify_page,
)
from hicache.dtypes import DType
from hicache.errors import (
    BadMagicError,
    CodecError,
    CorruptHeaderError,
    ForeignPageError,
    InvalidArgumentError,
    PayloadChecksumError,
    TruncatedPageError,
    UnsupportedVersionError,
)
from hicache.layouts import Layout
from hicache.tools.bench.cache.codec import kv_like

KEY = "ns-fmt-page0"


def bf16_page(n: int = 4096) -> tuple[np.ndarray, PageMeta]:
    data = kv_like(n, torch.bfloat16)
    meta = PageMeta("kv", DType.BFLOAT16, (n // 64, 64), Layout.PAGE_FIRST, 3, b"\x11" * 32)
    return data, meta


def joined(segments: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(s) for s in segments)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]
)
def test_round_trip(dtype: torch.dtype, compress: bool) -> None:
    n = 8192
    data = kv_like(n, dtype)
    meta = PageMeta("kv", DType.from_torch(dtype), (n,))
    stored = joined(encode_page(KEY, data, meta, compress=compress))
    header, payload = decode_page(KEY, stored, meta)
    assert bytes(payload) == data.tobytes()
    assert header.meta == meta and header.raw_len == data.nbytes


def test_compression_shrinks_bf16_kv_and_records_it() -> None:
    data, meta = bf16_page(1 << 16)
    segments = encode_page(KEY, data, meta, compress=True)
    header = parse_header(KEY, segments[0])
    assert header.codec is Codec.ZSTD_PLANES
    assert data.nbytes / header.payload_len > 1.35
    assert len(joined(segments)) == HEADER_SIZE + header.payload_len


def test_incompressible_payload_is_stored_plain() -> None:
    data = np.random.default_rng(1).integers(0, 256, 1 << 14, dtype=np.uint8)
    meta = PageMeta("kv", DType.UINT8, (data.size,))
    segments = encode_page(KEY, data, meta, compress=True)
    assert parse_header(KEY, segments[0]).codec is Codec.NONE


def test_uncompressed_encode_does_not_copy_the_payload() -> None:
    data, meta = bf16_page()
    header, payload = encode_page(KEY, data, meta)
    assert len(header) == HEADER_SIZE
    assert np.shares_memory(np.frombuffer(payload, np.uint8), data)


def test_decode_into_checks_a_payload_read_in_place() -> None:
    data, meta = bf16_page()
    stored = joined(encode_page(KEY, data, meta))
    header_buf, payload_buf = bytearray(HEADER_SIZE), bytearray(data.nbytes)
    header_buf[:] = stored[:HEADER_SIZE]
    payload_buf[:] = stored[HEADER_SIZE:]
    header = decode_into(KEY, header_buf, payload_buf, len(stored), meta)
    assert header.meta.page_index == 3 and header.meta.parent_hash == b"\x11" * 32
    assert bytes(payload_buf) == data.tobytes()


def test_decode_into_decompresses_into_the_payload_buffer() -> None:
    data, meta = bf16_page()
    stored = joined(encode_page(KEY, data, meta, compress=True))
    header_buf, payload_buf = bytearray(HEADER_SIZE), bytearray(data.nbytes)
    header_buf[:] = stored[:HEADER_SIZE]
    payload_buf[: len(stored) - HEADER_SIZE] = stored[HEADER_SIZE:]
    decode_into(KEY, header_buf, payload_buf, len(stored), meta)
    assert bytes(payload_buf) == data.tobytes()


def _rewrite_header(stored: bytes, offset: int, fmt: str, value: int) -> bytes:
    """Change one header field and re-seal the header checksum, as a buggy writer would."""
    header = bytearray(stored[:HEADER_SIZE])
    struct.pack_into(fmt, header, offset, value)
    struct.pack_into("<Q", header, 152, xxhash.xxh3_64_intdigest(bytes(header[:152])))
    return bytes(header) + stored[HEADER_SIZE:]


def test_every_corruption_is_a_typed_codec_error() -> None:
    data, meta = bf16_page()
    good = joined(encode_page(KEY, data, meta))
    flipped_payload = bytearray(good)
    flipped_payload[HEADER_SIZE + 100] ^= 0x01
    flipped_header = bytearray(good)
    flipped_header[70] ^= 0x40
    cases: list[tuple[bytes, type[CodecError]]] = [
        (b"XXXX" + good[4:], BadMagicError),
        (_rewrite_header(good, 4, "<H", 99), UnsupportedVersionError),
        (bytes(flipped_header), CorruptHeaderError),
        (bytes(flipped_payload), PayloadChecksumError),
        (good[:-1], TruncatedPageError),
        (good[:100], TruncatedPageError),
        (good + b"\x00", CorruptHeaderError),
        (_rewrite_header(good, 116, "<Q", 1 << 60), CorruptHeaderError),  # absurd length
        (_rewrite_header(good, 76, "<B", 200), CorruptHeaderError),  # unknown dtype
        (_rewrite_header(good, 78, "<B", 9), CorruptHeaderError),  # ndim > 6
        (_rewrite_header(good, 79, "<B", 7), CorruptHeaderError),  # unknown codec
    ]
    for stored, error in cases:
        with pytest.raises(error):
            decode_page(KEY, stored, meta)


def test_foreign_pages_are_refused() -> None:
    data, meta = bf16_page()
    stored = joined(encode_page(KEY, data, meta))
    with pytest.raises(ForeignPageError):
        decode_page("another-key", stored)
    for other in (
        PageMeta("kv", DType.FLOAT16, meta.shape, meta.layout),
        PageMeta("kv", DType.BFLOAT16, (32, 128), meta.layout),
        PageMeta("kv", DType.BFLOAT16, meta.shape, Layout.LAYER_FIRST),
        PageMeta("indexer", DType.BFLOAT16, meta.shape, meta.layout),
    ):
        with pytest.raises(ForeignPageError):
            decode_page(KEY, stored, other)


@pytest.mark.parametrize("where", ["raw plane", "zstd plane"])
def test_resealed_corruption_of_a_compressed_page_is_caught(where: str) -> None:
    """Even a writer that re-seals the stored checksum cannot make a page decode to wrong KV."""
    data, meta = bf16_page()
    stored = bytearray(joined(encode_page(KEY, data, meta, compress=True)))
    table = 2 * 9  # two byte planes: the mantissa plane raw first, then the zstd exponent plane
    offset = 40 if where == "raw plane" else table + data.nbytes // 2 + 40
    stored[HEADER_SIZE + offset] ^= 0xFF
    body = bytes(stored[HEADER_SIZE:])
    sealed = _rewrite_header(bytes(stored), 124, "<Q", xxhash.xxh3_64_intdigest(body))
    with pytest.raises((PayloadChecksumError, CorruptHeaderError)):
        decode_page(KEY, sealed, meta)


def test_bad_encode_arguments() -> None:
    data, meta = bf16_page()
    with pytest.raises(InvalidArgumentError):
        encode_page(KEY, data[:-2], meta)
    with pytest.raises(InvalidArgumentError):
        encode_page(KEY, np.zeros((8, 8))[:, ::2], PageMeta("kv", DType.FLOAT32, (32,)))
    for bad in (
        lambda: PageMeta("", DType.UINT8, (1,)),
        lambda: PageMeta("p" * 17, DType.UINT8, (1,)),
        lambda: PageMeta("kv", DType.UINT8, (1,) * 7),
        lambda: PageMeta("kv", DType.UINT8, (-1,)),
        lambda: PageMeta("kv", DType.UINT8, (1,), parent_hash=b"x"),
    ):
        with pytest.raises(InvalidArgumentError):
            bad()
    assert PageMeta("kv", DType.UINT8, (4,)).parent_hash == NO_PARENT


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_decode(blob: bytes) -> None:
    with pytest.raises(CodecError):
        decode_page(KEY, blob)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, HEADER_SIZE + 255), st.integers(1, 255))
def test_any_single_byte_flip_is_caught(position: int, mask: int) -> None:
    data = np.arange(256, dtype=np.uint8)
    meta = PageMeta("kv", DType.UINT8, (256,))
    stored = bytearray(joined(encode_page(KEY, data, meta)))
    stored[position] ^= mask
    with pytest.raises(CodecError):
        decode_page(KEY, bytes(stored), meta)


def _split_read(stored: bytes, payload_bytes: int) -> tuple[bytearray, bytearray]:
    header_buf, payload_buf = bytearray(HEADER_SIZE), bytearray(payload_bytes)
    header_buf[:] = stored[:HEADER_SIZE].ljust(HEADER_SIZE, b"\x00")
    tail = stored[HEADER_SIZE : HEADER_SIZE + payload_bytes]
    payload_buf[: len(tail)] = tail
    return header_buf, payload_buf


def _outcome(fn: object, *args: object) -> type[BaseException] | None:
    try:
        fn(*args)  # type: ignore[operator]
    except (CodecError, InvalidArgumentError) as exc:
        return type(exc)
    return None


@settings(max_examples=150, deadline=None)
@given(st.integers(0, HEADER_SIZE + 255), st.integers(0, 255), st.integers(-3, 3), st.booleans())
def test_check_into_agrees_with_decode_into(
    position: int, mask: int, length_delta: int, compress: bool
) -> None:
    """The fast check raises exactly what decode_into raises, and passes what it passes."""
    data = np.tile(np.arange(128, dtype=np.uint16), 2).view(np.uint8)[:256].copy()
    meta = PageMeta("kv", DType.BFLOAT16, (128,), Layout.PAGE_FIRST, 2, b"\x07" * 32)
    stored = bytearray(joined(encode_page(KEY, data, meta, compress)))
    stored[position % len(stored)] ^= mask
    nread = len(stored) + length_delta
    reads = [_split_read(bytes(stored), 256) for _ in range(2)]
    fast = _outcome(check_into, KEY, *reads[0], nread, meta)
    full = _outcome(decode_into, KEY, *reads[1], nread, meta)
    assert fast is full
    if fast is None:
        assert bytes(reads[0][1]) == data.tobytes() == bytes(reads[1][1])


def test_check_into_refuses_a_page_of_another_kind() -> None:
    data, meta = bf16_page()
    stored = joined(encode_page(KEY, data, meta))
    other = PageMeta("kv", DType.FLOAT16, meta.shape, meta.layout)
    header_buf, payload_buf = _split_read(stored, data.nbytes)
    with pytest.raises(ForeignPageError):
        check_into(KEY, header_buf, payload_buf, len(stored), other)


@pytest.mark.parametrize("bit", range(16))
def test_a_flipped_version_bit_is_corruption_not_a_newer_format(bit: int) -> None:
    data, meta = bf16_page()
    good = bytearray(joined(encode_page(KEY, data, meta)))
    good[4 + bit // 8] ^= 1 << (bit % 8)  # the format version field, header checksum not resealed
    with pytest.raises(CorruptHeaderError, match="version"):
        decode_page(KEY, bytes(good), meta)
    with pytest.raises(CorruptHeaderError):
        verify_page(KEY, bytes(good))


def test_a_newer_writers_page_is_still_an_unsupported_version() -> None:
    data, meta = bf16_page()
    newer = _rewrite_header(joined(encode_page(KEY, data, meta)), 4, "<H", 2)  # checksum sealed
    with pytest.raises(UnsupportedVersionError):
        decode_page(KEY, newer, meta)
