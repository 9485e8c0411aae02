"""Pages held as several contiguous runs of a host pool (hicache.integrations.page_runs).

The runs must be the view's own bytes (no copy, row-major, maximal), and the object they make
must be the very bytes ``encode_page`` makes of the joined payload, so every other reader and
``hicache verify`` accept it. ``check_runs`` must turn anything else into a CodecError (a miss).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.codec import (
    HEADER_SIZE,
    Codec,
    PageMeta,
    decode_page,
    encode_page,
    parse_header,
    verify_page,
)
from hicache.dtypes import DType
from hicache.errors import (
    BadMagicError,
    CodecError,
    ForeignPageError,
    InvalidArgumentError,
    PageKindMismatchError,
    PayloadChecksumError,
    TruncatedPageError,
)
from hicache.integrations.page_runs import (
    check_runs,
    contiguous_runs,
    encode_runs,
    runs_checksum,
    runs_within,
)
from hicache.layouts import Layout

KEY = "sgl-0123456789abcdef0123-" + "ab" * 32


# ----- helpers ------------------------------------------------------------------------------
def _buffer(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A host buffer whose every element differs, so a misplaced byte shows."""
    count = int(np.prod(shape))
    return torch.arange(count, dtype=torch.float32).reshape(shape).to(dtype)


def _flat_bytes(view: torch.Tensor) -> bytes:
    """What the runs must join to: the view's elements in row-major order."""
    # A new unit-stride tensor: a one-element flatten may keep a non-unit stride, which a uint8
    # view refuses.
    joined = torch.empty(view.numel(), dtype=view.dtype).copy_(view.flatten())
    return joined.view(torch.uint8).numpy().tobytes()


def _address(run: memoryview) -> int:
    return int(np.frombuffer(run, dtype=np.uint8).ctypes.data)


def _storage_span(view: torch.Tensor) -> tuple[int, int]:
    storage = view.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _meta(view: torch.Tensor, pool: str = "kv") -> PageMeta:
    return PageMeta(
        pool=pool,
        dtype=DType.from_torch(view.dtype),
        shape=tuple(view.shape),
        layout=Layout.PAGE_FIRST,
    )


def _joined(segments: Sequence[bytes | memoryview]) -> bytes:
    return b"".join(bytes(segment) for segment in segments)


def _read_back(stored: bytes, dest: torch.Tensor) -> tuple[memoryview, list[memoryview], int]:
    """What a backend's scatter read leaves: the header, ``dest``'s runs filled, the length."""
    header = memoryview(bytearray(HEADER_SIZE))
    header[:] = stored[:HEADER_SIZE]
    runs = contiguous_runs(dest)
    offset = HEADER_SIZE
    for run in runs:
        run[:] = stored[offset : offset + run.nbytes]
        offset += run.nbytes
    return header, runs, len(stored)


def _assert_runs_of(view: torch.Tensor, runs: list[memoryview]) -> None:
    """The properties every run list must have: right bytes, in the view's memory, maximal."""
    assert b"".join(bytes(run) for run in runs) == _flat_bytes(view)
    low, high = _storage_span(view)
    for run in runs:
        # Inside the tensor's own storage: a view of its memory, not a copy.
        assert low <= _address(run) and _address(run) + run.nbytes <= high
    for before, after in itertools.pairwise(runs):
        # Maximal: two runs that touch would have been one.
        assert _address(before) + before.nbytes != _address(after)


# The views an engine's host pool hands out, with the number of runs each must give.
VIEWS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "whole buffer": (lambda b: b, 1),
    "leading slice": (lambda b: b[1:2], 1),
    "token slice per K/V": (lambda b: b[:, 1:3], 2),
    "size-1 dim with a big stride": (lambda b: b[:, 1:2], 2),
    "one token per K/V and layer": (lambda b: b[:, :, 2], 6),
    "transposed": (lambda b: b.transpose(0, 1), 6),
    "every other element": (lambda b: b[..., 1::2], 2 * 3 * 4 * 2),
    "scalar": (lambda b: b[1, 2, 3, 4], 1),
}


# ----- contiguous_runs ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_runs_are_the_views_bytes_in_place(name: str) -> None:
    make, expected_runs = VIEWS[name]
    view = make(_buffer((2, 3, 4, 5)))
    runs = contiguous_runs(view)
    assert len(runs) == expected_runs
    _assert_runs_of(view, runs)


def test_writing_a_run_writes_the_tensor() -> None:
    buf = torch.zeros(2, 3, 4, dtype=torch.float16)
    view = buf[:, 1]  # two runs, K and V apart
    runs = contiguous_runs(view)
    payload = torch.arange(8, dtype=torch.float16)
    # A reader fills the runs in row-major order; the tensor must see exactly that.
    raw = payload.view(torch.uint8).numpy().tobytes()
    runs[0][:] = raw[: runs[0].nbytes]
    runs[1][:] = raw[runs[0].nbytes :]
    assert torch.equal(view.flatten(), payload)
    assert torch.count_nonzero(buf[:, 0]) == 0 and torch.count_nonzero(buf[:, 2]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_runs_cover_every_dtype_as_bytes(dtype: torch.dtype) -> None:
    # bfloat16 has no numpy type: the runs go through uint8, and must still be byte-exact.
    view = _buffer((2, 3, 4), dtype)[:, 1:]
    runs = contiguous_runs(view)
    assert all(run.format == "B" and run.ndim == 1 for run in runs)
    _assert_runs_of(view, runs)


def test_empty_view_has_no_runs() -> None:
    assert contiguous_runs(_buffer((2, 3))[:, 3:]) == []


def test_a_non_cpu_view_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="CPU"):
        contiguous_runs(torch.empty(2, 3, device="meta"))


def _dense_to_bytes_only(view: torch.Tensor, runs: list[memoryview]) -> None:
    """The bytes and the memory of the runs, without asking them to be maximal."""
    assert b"".join(bytes(run) for run in runs) == _flat_bytes(view)
    low, high = _storage_span(view)
    assert all(low <= _address(r) and _address(r) + r.nbytes <= high for r in runs)


def _sliced_views(
    dtypes: Sequence[torch.dtype], steps: tuple[int, int], min_extent: int, permute: bool
) -> st.SearchStrategy[torch.Tensor]:
    """Slices of a dense buffer, possibly permuted: what host pools return as a page."""

    @st.composite
    def views(draw: st.DrawFn) -> torch.Tensor:
        dims = st.integers(min_extent, 4)
        shape = tuple(draw(st.lists(dims, min_size=1, max_size=4)))
        view = _buffer(shape, draw(st.sampled_from(list(dtypes))))
        index = []
        for size in shape:
            start = draw(st.integers(0, size - min_extent))
            stop = draw(st.integers(start + min_extent, size))
            index.append(slice(start, stop, draw(st.integers(*steps))))
        view = view[tuple(index)]
        return view.permute(*draw(st.permutations(range(view.dim())))) if permute else view

    return views()


@settings(max_examples=150, deadline=None)
@given(_sliced_views([torch.uint8], steps=(1, 2), min_extent=1, permute=True))
def test_runs_of_any_sliced_view_hold_its_bytes(view: torch.Tensor) -> None:
    _dense_to_bytes_only(view, contiguous_runs(view))


@settings(max_examples=150, deadline=None)
@given(_sliced_views([torch.uint8, torch.bfloat16], steps=(1, 2), min_extent=1, permute=True))
def test_runs_within_the_whole_buffer_are_the_same_runs(view: torch.Tensor) -> None:
    """The arithmetic fast path (slices of the pool's whole buffer) gives the same runs, in
    the same memory, as the tensor walk."""
    base_tensor = view._base if view._base is not None else view
    base = memoryview(base_tensor.reshape(-1).view(torch.uint8).numpy())
    runs = runs_within(base, base_tensor.data_ptr(), view)
    assert runs is not None
    expected = contiguous_runs(view)
    assert [bytes(r) for r in runs] == [bytes(r) for r in expected]
    assert [_address(r) for r in runs] == [_address(r) for r in expected]


def test_runs_within_refuses_a_view_of_another_buffer() -> None:
    pool, other = _buffer((4, 8)), _buffer((4, 8))
    base = memoryview(pool.view(-1).view(torch.uint8).numpy())
    assert runs_within(base, pool.data_ptr(), other[1:3]) is None
    assert runs_within(base, pool.data_ptr(), pool[1:3]) is not None


@settings(max_examples=150, deadline=None)
@given(_sliced_views([torch.bfloat16, torch.float32], steps=(1, 1), min_extent=2, permute=False))
def test_runs_of_unit_step_slices_are_maximal(view: torch.Tensor) -> None:
    # Unit steps, dims in order and no size-1 dims (host pool pages): the known failures
    # below (single-element rows, rows that touch) cannot occur, so every property must hold.
    _assert_runs_of(view, contiguous_runs(view))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(4, dtype=torch.float32).reshape(2, 2)[:, ::2],  # shape (2, 1)
        lambda: torch.arange(2, dtype=torch.bfloat16)[::2],  # shape (1,), stride (2,)
    ],
    ids=["column-of-one", "one-strided-element"],
)
def test_runs_of_single_element_rows_with_a_stride(make: Callable[[], torch.Tensor]) -> None:
    view = make()
    _assert_runs_of(view, contiguous_runs(view))


# ----- runs_checksum ------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=5))
def test_checksum_ignores_where_runs_split(data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(cut, len(data)) for cut in cuts), len(data)]
    runs = [memoryview(data)[a:b] for a, b in itertools.pairwise(bounds)]
    assert runs_checksum(runs) == xxhash.xxh3_64_intdigest(data)


# ----- encode_runs --------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_encode_runs_is_encode_page_of_the_joined_payload(name: str) -> None:
    view = VIEWS[name][0](_buffer((2, 3, 4, 5)))
    runs = contiguous_runs(view)
    meta = _meta(view)
    stored = _joined(encode_runs(KEY, runs, meta))
    assert stored == _joined(encode_page(KEY, _flat_bytes(view), meta))
    # And so any reader accepts it the usual way.
    verify_page(KEY, stored)
    _, payload = decode_page(KEY, stored, meta)
    assert bytes(payload) == _flat_bytes(view)


def test_encode_runs_passes_the_runs_themselves() -> None:
    view = _buffer((2, 3, 4))[:, 1:]
    runs = contiguous_runs(view)
    segments = encode_runs(KEY, runs, _meta(view))
    # No copy: the segments after the header are the caller's runs, object for object.
    assert len(segments) == len(runs) + 1
    assert all(seg is run for seg, run in zip(segments[1:], runs))
    assert len(segments[0]) == HEADER_SIZE


def test_encode_runs_refuses_runs_of_another_size() -> None:
    view = _buffer((2, 3, 4))[:, 1:]
    runs = contiguous_runs(view)
    with pytest.raises(InvalidArgumentError, match="bytes"):
        encode_runs(KEY, runs[:-1], _meta(view))


def test_encode_runs_keeps_the_metas_chain_place() -> None:
    view = _buffer((2, 3, 4))[:, 1:]
    meta = PageMeta("kv", DType.BFLOAT16, tuple(view.shape), page_index=3, parent_hash=b"\1" * 32)
    stored = _joined(encode_runs(KEY, contiguous_runs(view), meta))
    assert stored == _joined(encode_page(KEY, _flat_bytes(view), meta))


# ----- check_runs ---------------------------------------------------------------------------
def test_check_runs_accepts_a_page_read_into_another_layout() -> None:
    source = _buffer((2, 3, 4, 5))[:, 1:3]
    stored = _joined(encode_runs(KEY, contiguous_runs(source), _meta(source)))
    # The destination is a view of another pool shape: same page kind, other runs.
    dest = torch.zeros(2, 6, 4, 5, dtype=torch.bfloat16)[:, 2:4]
    header, runs, nread = _read_back(stored, dest)
    check_runs(KEY, header, runs, nread, _meta(dest))
    assert torch.equal(dest, source)


def _stored_page() -> tuple[bytes, torch.Tensor]:
    source = _buffer((2, 3, 4))[:, 1:]
    return _joined(encode_runs(KEY, contiguous_runs(source), _meta(source))), source


def _dest_like(source: torch.Tensor) -> torch.Tensor:
    return torch.zeros(2, 4, 4, dtype=source.dtype)[:, 2:]


def test_check_runs_refuses_a_short_read() -> None:
    stored, source = _stored_page()
    header, runs, nread = _read_back(stored, _dest_like(source))
    with pytest.raises(TruncatedPageError):
        check_runs(KEY, header, runs, nread - 1, _meta(source))


def test_check_runs_refuses_a_read_longer_than_the_page() -> None:
    stored, source = _stored_page()
    header, runs, nread = _read_back(stored, _dest_like(source))
    with pytest.raises(CodecError):
        check_runs(KEY, header, runs, nread + 1, _meta(source))


def test_check_runs_refuses_a_short_header() -> None:
    stored, source = _stored_page()
    _, runs, nread = _read_back(stored, _dest_like(source))
    with pytest.raises(TruncatedPageError):
        check_runs(KEY, memoryview(stored[: HEADER_SIZE - 1]), runs, nread, _meta(source))


def test_check_runs_refuses_bad_magic() -> None:
    stored, source = _stored_page()
    header, runs, nread = _read_back(stored, _dest_like(source))
    header[:4] = b"XXXX"
    with pytest.raises(BadMagicError):
        check_runs(KEY, header, runs, nread, _meta(source))


def test_check_runs_refuses_another_key() -> None:
    stored, source = _stored_page()
    header, runs, nread = _read_back(stored, _dest_like(source))
    with pytest.raises(ForeignPageError):
        check_runs(KEY + "x", header, runs, nread, _meta(source))


@pytest.mark.parametrize(
    "expect",
    [
        PageMeta("kv", DType.BFLOAT16, (2, 4, 2), Layout.PAGE_FIRST),  # same bytes, other shape
        PageMeta("kv", DType.FLOAT16, (2, 2, 4), Layout.PAGE_FIRST),  # same bytes, other dtype
        PageMeta("dsa", DType.BFLOAT16, (2, 2, 4), Layout.PAGE_FIRST),  # other pool
        PageMeta("kv", DType.BFLOAT16, (2, 2, 4), Layout.LAYER_FIRST),  # other layout
    ],
)
def test_check_runs_refuses_another_kind_of_page(expect: PageMeta) -> None:
    stored, source = _stored_page()
    header, runs, nread = _read_back(stored, _dest_like(source))
    with pytest.raises(PageKindMismatchError):
        check_runs(KEY, header, runs, nread, expect)


def test_check_runs_refuses_a_compressed_page() -> None:
    source = torch.zeros(2, 64, 8, dtype=torch.bfloat16)  # zeros compress: planes are stored
    segments = encode_page(KEY, _flat_bytes(source), _meta(source), compress=True)
    assert parse_header(KEY, segments[0]).codec is Codec.ZSTD_PLANES
    stored = _joined(segments)
    dest = torch.empty_like(source)
    header = memoryview(bytearray(stored[:HEADER_SIZE]))
    # A consistent length, so only the codec can be what is refused.
    with pytest.raises(PageKindMismatchError):
        check_runs(KEY, header, contiguous_runs(dest), len(stored), _meta(source))


def test_check_runs_refuses_a_damaged_payload() -> None:
    stored, source = _stored_page()
    header, runs, nread = _read_back(stored, _dest_like(source))
    runs[-1][0] ^= 0xFF
    with pytest.raises(PayloadChecksumError):
        check_runs(KEY, header, runs, nread, _meta(source))
