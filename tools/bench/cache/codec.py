"""``hicache bench codec``: compression ratio and speed of the page codec on KV-like data.

Each figure is best of N on one core. ``checksum_*`` rows are the uncompressed path, whose cost
is the header and the xxh3 checksum of the payload.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.codec import PageMeta, decode_page, encode_page
from hicache.dtypes import DType
from hicache.errors import InvalidArgumentError
from hicache.tools.bench.bench_flags import JSON_LINES, add_bench_parser, repeats_flag
from hicache.tools.bench.limits import MAX_OBJECT_BYTES
from hicache.tools.cli_parsing import Flag, size_range

if TYPE_CHECKING:
    import torch

__all__ = [
    "MIN_PAGE_BYTES",
    "add_bench_codec_parser",
    "kv_like",
    "run_bench_codec",
    "run_codec_bench",
]


def kv_like(n_elements: int, dtype: torch.dtype, seed: int = 0) -> np.ndarray:
    """Normal values with a few outlier channels, as K/V activations look, as raw bytes."""
    import torch  # here, not above: building the parser must not pay for it

    gen = torch.Generator().manual_seed(seed)
    channels = 128
    x = torch.randn(n_elements // channels, channels, generator=gen)
    outliers = torch.randperm(channels, generator=gen)[:4]
    x[:, outliers] *= 16.0
    return x.to(dtype).view(torch.uint8).numpy().reshape(-1)


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)  # a timer tick, never 0: the rates divide by it


def _bench_one(label: str, data: np.ndarray, dtype: DType, repeats: int) -> dict[str, Any]:
    n = data.nbytes
    meta = PageMeta("kv", dtype, (n // dtype.itemsize,))
    segments = encode_page("bench", data, meta, compress=True)
    stored = b"".join(bytes(s) for s in segments)
    plain = b"".join(bytes(s) for s in encode_page("bench", data, meta))
    _, payload = decode_page("bench", stored, meta)
    if bytes(payload) != data.tobytes():  # a benchmark of a wrong codec is worthless
        raise RuntimeError("codec round trip mismatch")
    compress_s = _best_seconds(lambda: encode_page("bench", data, meta, compress=True), repeats)
    decompress_s = _best_seconds(lambda: decode_page("bench", stored, meta), repeats)
    checksum_s = _best_seconds(lambda: encode_page("bench", data, meta), repeats)
    verify_s = _best_seconds(lambda: decode_page("bench", plain, meta), repeats)
    return {
        "data": label,
        "bytes": n,
        "ratio": round(n / (len(stored) - (len(plain) - n)), 4),
        "compress_gbps": round(n / compress_s / 1e9, 3),
        "decompress_gbps": round(n / decompress_s / 1e9, 3),
        "checksum_encode_gbps": round(n / checksum_s / 1e9, 3),
        "checksum_decode_gbps": round(n / verify_s / 1e9, 3),
    }


MIN_PAGE_BYTES = 256  # one row of 128 bf16 channels


def run_codec_bench(page_bytes: int = 2 << 20, repeats: int = 5) -> list[dict[str, Any]]:
    """The codec on bf16 and fp8 KV-like pages of about ``page_bytes`` bytes, best of
    ``repeats``; raises InvalidArgumentError for a page under 256 bytes or no repeat."""
    if page_bytes < MIN_PAGE_BYTES or repeats < 1:
        raise InvalidArgumentError(
            f"page_bytes must be at least {MIN_PAGE_BYTES} and repeats at least 1, "
            f"got {page_bytes} and {repeats}"
        )
    import torch

    torch.set_num_threads(1)
    bf16 = kv_like(page_bytes // 2, torch.bfloat16)
    fp8 = kv_like(page_bytes, torch.float8_e4m3fn)
    return [
        _bench_one("bf16_kv", bf16, DType.BFLOAT16, repeats),
        _bench_one("fp8_e4m3_kv", fp8, DType.FLOAT8_E4M3FN, repeats),
    ]


def add_bench_codec_parser(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``codec`` to the ``hicache bench`` subcommands; :func:`run_bench_codec` runs it."""
    page_bytes = Flag(
        "--object-bytes", size_range(MIN_PAGE_BYTES, MAX_OBJECT_BYTES), 2 << 20,
        f"bytes of KV-like data per page (at least {MIN_PAGE_BYTES})",
    )  # fmt: skip
    flags = (page_bytes, repeats_flag(5), JSON_LINES)
    help_text = "page codec: compression ratio and speed"
    return add_bench_parser(bench_sub, "codec", help_text, flags, run_bench_codec)


def run_bench_codec(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``hicache bench codec``: :func:`run_codec_bench` with the parsed flags."""
    return run_codec_bench(page_bytes=args.object_bytes, repeats=args.repeats)
