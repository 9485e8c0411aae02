"""Unit tests of the backend contract's helpers and of config building."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import pytest

from hicache.backends.base import (
    Capabilities,
    as_segments,
    copy_if_fits,
    copy_into_segments,
    join_segments,
    segments_nbytes,
)
from hicache.backends.memory import MemoryBackend, MemoryConfig
from hicache.backends.segments import IOV_MAX, byte_runs, split_iov
from hicache.errors import ConfigError, InvalidArgumentError, InvalidKeyError
from hicache.typed_config import build_config, parse_bool, parse_size

# ----- as_segments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [b"abcdef", bytearray(b"abcdef"), memoryview(b"abcdef"), np.frombuffer(b"abcdef", np.uint8)],
    ids=["bytes", "bytearray", "memoryview", "numpy"],
)
def test_as_segments_of_one_buffer(value: object) -> None:
    (seg,) = as_segments(value, writable=False)
    assert (seg.format, seg.ndim, seg.nbytes, bytes(seg)) == ("B", 1, 6, b"abcdef")


def test_as_segments_flattens_typed_arrays_without_copying() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    (seg,) = as_segments(array, writable=True)
    assert (seg.format, seg.ndim, seg.nbytes) == ("B", 1, 48)
    seg[:4] = np.float32(7).tobytes()  # writes land in the caller's array: a view, not a copy
    assert array[0, 0] == 7
    (scalar,) = as_segments(np.array(5, dtype=np.int64), writable=False)
    assert scalar.nbytes == 8


def test_as_segments_of_a_list_or_tuple_keeps_order() -> None:
    parts = [b"ab", bytearray(b"cd"), np.frombuffer(b"ef", np.uint8), memoryview(b"")]
    segs = as_segments(parts, writable=False)
    assert [bytes(s) for s in segs] == [b"ab", b"cd", b"ef", b""]
    assert [bytes(s) for s in as_segments(tuple(parts), writable=False)] == [
        b"ab",
        b"cd",
        b"ef",
        b"",
    ]
    assert as_segments([], writable=True) == []


@pytest.mark.parametrize(
    "value",
    [
        np.zeros(10, np.uint8)[::2],
        np.zeros((4, 4), np.float32, order="F"),
        memoryview(bytearray(10))[::3],
        [bytearray(2), np.zeros(10, np.uint8)[::2]],
    ],
    ids=["strided", "fortran", "memoryview-step", "in-a-list"],
)
def test_as_segments_refuses_non_contiguous(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        as_segments(value, writable=False)


def test_as_segments_refuses_read_only_only_when_writable() -> None:
    frozen = np.zeros(4, np.uint8)
    frozen.flags.writeable = False
    for value in (b"abcd", memoryview(b"abcd"), frozen, [bytearray(2), b"xy"]):
        assert segments_nbytes(as_segments(value, writable=False)) == 4
        with pytest.raises(InvalidArgumentError, match="writable"):
            as_segments(value, writable=True)


@pytest.mark.parametrize(
    "value",
    ["text", 42, None, np.array([1, "a"], dtype=object), np.zeros(2, "M8[s]"), [b"ok", 3.5]],
    ids=["str", "int", "none", "object-array", "datetime-array", "list-with-float"],
)
def test_as_segments_refuses_non_buffers(value: object) -> None:
    with pytest.raises(InvalidArgumentError):
        as_segments(value, writable=False)


# ----- join and copy ----------------------------------------------------------------------------


def test_join_segments_copies_back_to_back() -> None:
    source = bytearray(b"hello")
    joined = join_segments(as_segments([source, b"", b" world"], writable=False))
    assert isinstance(joined, bytearray) and joined == b"hello world"
    source[:] = b"HELLO"
    assert joined == b"hello world"  # a copy, not a view
    assert join_segments([]) == bytearray()


@pytest.mark.parametrize(("pieces", "parts"), [(12, 4), (5, 8), (2500, 2), (1, 1)])
def test_split_iov_cuts_runs_that_cover_the_pieces_in_order(pieces: int, parts: int) -> None:
    """Stretches in order and back to back from the offset, each at most IOV_MAX pieces, and
    no more of them than needed for ``parts`` (or for the piece limit)."""
    iov: list[memoryview | bytes] = [bytes([i % 251]) * (1 + i % 7) for i in range(pieces)]
    stretches = split_iov(iov, 4096, parts)
    assert [p for part, _, _ in stretches for p in part] == iov
    at = 4096
    for part, offset, size in stretches:
        assert offset == at and size == sum(len(p) for p in part) and len(part) <= IOV_MAX
        at += size
    assert len(stretches) <= max(parts, -(-pieces // IOV_MAX)) + 1


def test_byte_runs_cut_in_order_with_a_large_item_alone() -> None:
    runs = byte_runs([1 << 10, 1 << 10, 3 << 10, 1 << 10], 2 << 10)
    assert [list(run) for run in runs] == [[0, 1], [2], [3]]
    assert byte_runs([], 1) == []


def test_copy_into_segments_spreads_across_boundaries() -> None:
    parts = [bytearray(3), bytearray(0), bytearray(4), bytearray(5)]
    copy_into_segments(memoryview(b"abcdefghij"), as_segments(parts, writable=True))
    assert parts == [b"abc", b"", b"defg", b"hij\0\0"]  # the unused tail is left alone


def test_copy_into_segments_of_exact_and_empty_sources() -> None:
    parts = [bytearray(b"..."), bytearray(b"..")]
    copy_into_segments(memoryview(b"12345"), as_segments(parts, writable=True))
    assert parts == [b"123", b"45"]
    copy_into_segments(memoryview(b""), as_segments(parts, writable=True))
    assert parts == [b"123", b"45"]


def test_copy_if_fits_reports_the_size_and_copies_only_what_fits() -> None:
    parts = [bytearray(b"...."), bytearray(b"...")]
    assert copy_if_fits(b"abcde", as_segments(parts, writable=True)) == 5
    assert parts == [b"abcd", b"e.."]
    # too large: the size tells the caller it did not fit, and the buffers stay as they were
    assert copy_if_fits(bytearray(b"12345678"), as_segments(parts, writable=True)) == 8
    assert parts == [b"abcd", b"e.."]


# ----- base-class behaviour a backend inherits ---------------------------------------------------


class _CountingBackend(MemoryBackend):
    """Counts the calls the base makes into the backend."""

    def __init__(self) -> None:
        super().__init__(MemoryConfig())
        self.exists_batches: list[list[str]] = []
        self.get_batches: list[list[str]] = []

    async def _exists(self, keys: list[str]) -> list[bool]:
        self.exists_batches.append(keys)
        return await super()._exists(keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        self.get_batches.append(keys)
        return await super()._get_into(keys, buffers)


async def test_leading_hits_stops_at_the_first_batch_with_a_miss() -> None:
    backend = _CountingBackend()
    keys = [f"k{i}" for i in range(10)]
    assert await backend.put(keys[:3], [b"x"] * 3) == [True] * 3
    assert await backend.leading_hits(keys, batch_size=2) == 3
    assert backend.exists_batches == [["k0", "k1"], ["k2", "k3"]]


async def test_leading_hits_validates_every_key_before_asking() -> None:
    backend = _CountingBackend()
    with pytest.raises(InvalidKeyError):
        await backend.leading_hits(["missing", "a/b"], batch_size=1)
    assert backend.exists_batches == []


async def test_get_reads_in_one_batch_and_retries_only_what_did_not_fit() -> None:
    backend = _CountingBackend()
    assert await backend.put(["small", "big"], [b"s", b"b" * 100]) == [True, True]
    assert await backend.get(["small", "absent", "big"], size_hint=10) == [b"s", None, b"b" * 100]
    assert backend.get_batches == [["small", "absent", "big"], ["big"]]


async def test_a_backend_answering_the_wrong_count_is_caught() -> None:
    class Short(MemoryBackend):
        async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
            return []

    with pytest.raises(ValueError):
        await Short().get_into(["a"], [bytearray(1)])


def test_capabilities_defaults_and_frozen() -> None:
    caps = Capabilities()
    assert (caps.persistent, caps.listable, caps.max_object_bytes) == (False, True, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.persistent = True  # type: ignore[misc]


# ----- build_config ------------------------------------------------------------------------------


class _Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe-mode"


class _Labelled(enum.Enum):
    """Like DType: a tuple value and a ``label``."""

    ONE = ("one-label", 1)
    TWO = ("two-label", 2)

    def __init__(self, label: str, code: int) -> None:
        self.label = label
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class _Sample:
    max_bytes: int = 0
    count: int = 1
    fsync: bool = False
    ratio: float = 0.5
    name: str = "x"
    mode: _Mode = _Mode.FAST
    limit_bytes: int | None = None
    labelled: _Labelled | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Required:
    root: str


def test_build_config_defaults_and_text_values() -> None:
    assert build_config(_Sample, {}) == _Sample()
    text = {"max_bytes": "512M", "count": "7", "fsync": "yes", "ratio": "0.25", "name": "n"}
    built = build_config(_Sample, {**text, "mode": "SAFE", "limit_bytes": "1.5K"})
    assert built == _Sample(512 << 20, 7, True, 0.25, "n", _Mode.SAFE, 1536)


def test_build_config_sizes_only_for_bytes_fields() -> None:
    assert build_config(_Sample, {"max_bytes": "10G"}).max_bytes == 10 << 30
    with pytest.raises(ConfigError, match=r"_Sample\.count"):
        build_config(_Sample, {"count": "512M"})


@pytest.mark.parametrize("text", ["fast", "FAST", " Fast "])
def test_build_config_enum_by_name(text: str) -> None:
    assert build_config(_Sample, {"mode": text}).mode is _Mode.FAST


def test_build_config_enum_by_value_or_label() -> None:
    assert build_config(_Sample, {"mode": "safe-mode"}).mode is _Mode.SAFE
    assert build_config(_Sample, {"mode": _Mode.SAFE}).mode is _Mode.SAFE
    assert build_config(_Sample, {"labelled": "two-label"}).labelled is _Labelled.TWO
    assert build_config(_Sample, {"labelled": "one"}).labelled is _Labelled.ONE
    for bad in ("bogus", ""):
        with pytest.raises(ConfigError, match="use one of fast, safe"):
            build_config(_Sample, {"mode": bad})


@pytest.mark.parametrize("text", ["none", "NULL", "", None])
def test_build_config_optional_none(text: str | None) -> None:
    built = build_config(_Sample, {"limit_bytes": text, "labelled": text})
    assert (built.limit_bytes, built.labelled) == (None, None)


def test_build_config_typed_values() -> None:
    assert build_config(_Sample, {"count": 5, "ratio": 2}) == _Sample(count=5, ratio=2.0)
    assert isinstance(build_config(_Sample, {"ratio": 2}).ratio, float)
    bad: list[tuple[str, object]] = [
        ("count", True),
        ("count", 1.5),
        ("fsync", 1),
        ("name", 3),
        ("mode", None),
        ("max_bytes", False),
    ]
    for field, value in bad:
        with pytest.raises(ConfigError, match=rf"_Sample\.{field} = "):
            build_config(_Sample, {field: value})


def test_build_config_unknown_field_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        build_config(_Sample, {"max_byte": "1", "zzz": 1})
    message = str(info.value)
    assert "max_byte, zzz" in message
    assert "known: count, fsync, labelled, limit_bytes, max_bytes, mode, name, ratio" in message


def test_build_config_bad_value_names_the_field_and_value() -> None:
    with pytest.raises(ConfigError) as info:
        build_config(_Sample, {"fsync": "maybe"})
    assert "_Sample.fsync = 'maybe'" in str(info.value) and "true or false" in str(info.value)
    with pytest.raises(ConfigError, match=r"_Sample\.max_bytes = '1e400'"):
        build_config(_Sample, {"max_bytes": "1e400"})


def test_build_config_missing_required_and_post_init_errors() -> None:
    with pytest.raises(ConfigError, match="root"):
        build_config(_Required, {})
    with pytest.raises(ConfigError, match="capacity_bytes"):
        build_config(MemoryConfig, {"capacity_bytes": "0"})
    with pytest.raises(TypeError):
        build_config(dict, {})  # type: ignore[type-var]


# ----- parse_size and parse_bool -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("10b", 10),
        ("1k", 1024),
        ("1KiB", 1024),
        ("1 KB", 1024),
        ("512M", 512 << 20),
        ("512mib", 512 << 20),
        (" 2T ", 2 << 40),
        ("1.5K", 1536),
        ("0.5k", 512),
        (".5k", 512),
        ("3.", 3),
        ("1_000", 1000),
        ("123456789012345678901234567890T", 123456789012345678901234567890 << 40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "k",
        "-1",
        "+1",
        "1.5",
        "0.3k",
        "1e3",
        "1e400",
        "0x10",
        "1.5.5",
        "10 X",
        "1 2",
        "inf",
        "nan",
        "\u0663",
        "1kk",
    ],
)
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a (size|whole number)"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
    ],
)
def test_parse_bool(text: str, expected: bool) -> None:
    assert parse_bool(text) is expected


@pytest.mark.parametrize("text", ["", "2", "maybe", "t"])
def test_parse_bool_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool(text)
