"""The I/O kernel bench's two sides move the same bytes (so its ratio compares like with like),
and its result has a ratio per direction. On the CPU here; ``bench seed`` runs it on CUDA."""

from __future__ import annotations

import math

import torch

from hicache.layouts import TransferStream
from hicache.tools.bench.cache.io_kernel import _buffers, _kernel, _page_loop, kernel_vs_page_loop


def test_the_kernel_and_the_page_loop_move_the_same_bytes() -> None:
    b = _buffers("cpu", pages=3, page_size=8, layers=2)
    stream = TransferStream("cpu")
    pages = b.host_pages
    host = b.host.view(torch.int16)  # random bytes: bf16 NaNs would never compare equal
    _kernel(stream, b, to_host=True)
    by_kernel = host[pages].clone()
    host[pages] = 0
    _page_loop(stream, b, to_host=True)
    assert torch.equal(host[pages], by_kernel)
    others = sorted(set(range(len(host))) - set(pages))
    before = host[others].clone()  # pages neither side names are left alone
    pool = b.pool.view(torch.int16)
    pool.zero_()
    _kernel(stream, b, to_host=False)
    loaded = pool.clone()
    pool.zero_()
    _page_loop(stream, b, to_host=False)
    assert torch.equal(pool, loaded) and loaded.abs().sum() > 0
    assert torch.equal(host[others], before)


def test_result_has_a_ratio_per_direction() -> None:
    out = kernel_vs_page_loop("cpu", pages=2, repeats=2, page_size=8, layers=2)
    assert out["copies_per_page"] == 2 * 2
    for op in ("gather", "scatter"):
        row = out[op]
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert math.isfinite(row["kernel_gbps"]) and row["kernel_gbps"] > 0
    assert out["ratio"] == min(out["gather"]["ratio"], out["scatter"]["ratio"])
