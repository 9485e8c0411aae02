"""SGLang's HiCacheController page I/O functions over the adapter, for every host layout: the
zero-copy pair (``interface_v1``) and the generic pair, each reading what the other wrote."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "sglang", reason="SGLang is installed only in the SGLang venv (make test-sglang)"
)

import torch
from sglang.srt.managers.cache_controller import (
    HiCacheController,
    PrefetchOperation,
    get_storage_hash_str,
)
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_kit import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE,
    fill_random,
    mha_pools,
    mla_pools,
    one_rank,
    page_bytes,
    slots,
)

from hicache.integrations.sglang import extra_config

PATHS = ("zero_copy", "generic")
SOURCE_PAGES = [2, 3, 4, 5]
TARGET_PAGES = [7, 1, 9, 6]  # other slots, out of order: pages land where they are asked to


def controller(pools, url: str, zero_copy: bool, model: str = "org/tiny") -> HiCacheController:
    device, host = pools
    allocator = TokenToKVPoolAllocator(
        size=device.size, dtype=device.dtype, device="cpu", kvcache=device, need_sort=False
    )
    extra = extra_config(url, interface_v1=int(zero_copy))
    with one_rank():
        ctl = HiCacheController(
            allocator,
            host,
            PAGE,
            None,
            threading.Event(),
            io_backend="direct",
            storage_backend="dynamic",
            model_name=model,
            storage_backend_extra_config=extra,
        )
    return ctl


@contextlib.contextmanager
def zero_copy_controller(
    layout: str, seed: int, url: str
) -> Iterator[tuple[HiCacheController, tuple[Any, Any]]]:
    """A zero-copy controller over MHA pools whose host pool holds random bytes (``seed``), and
    those pools; its storage is detached on the way out."""
    pools = mha_pools(layout)
    fill_random(pools[1], seed=seed)
    ctl = controller(pools, url, zero_copy=True)
    try:
        yield ctl, pools
    finally:
        ctl.detach_storage_backend()


def write_pages(ctl: HiCacheController, path: str, hashes: list[str], pages: list[int]) -> bool:
    set_page = ctl._page_set_zero_copy if path == "zero_copy" else ctl._generic_page_set
    return set_page(hashes, slots(pages))


def read_pages(ctl: HiCacheController, path: str, hashes: list[str], pages: list[int]) -> int:
    get_page = ctl._page_get_zero_copy if path == "zero_copy" else ctl._generic_page_get
    operation = PrefetchOperation("req", [])
    return get_page(operation, hashes, slots(pages))


def roundtrip(make_pools, layout: str, writer: str, reader: str, tmp_path) -> None:
    url = f"file://{tmp_path}"
    source = make_pools(layout)
    fill_random(source[1], seed=11)
    target = make_pools(layout)
    tokens = list(range(500, 500 + len(SOURCE_PAGES) * PAGE))
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    a = controller(source, url, writer == "zero_copy")
    b = controller(target, url, reader == "zero_copy")
    try:
        assert a.page_set_func.__name__ == (
            "_page_set_zero_copy" if writer == "zero_copy" else "_generic_page_set"
        )
        assert write_pages(a, writer, hashes, SOURCE_PAGES)
        before = [page_bytes(target[1], p * PAGE) for p in TARGET_PAGES]
        assert read_pages(b, reader, hashes, TARGET_PAGES) == len(hashes)
        for src, dst, old in zip(SOURCE_PAGES, TARGET_PAGES, before, strict=True):
            got = page_bytes(target[1], dst * PAGE)
            assert got == page_bytes(source[1], src * PAGE)
            assert got != old
    finally:
        a.detach_storage_backend()
        b.detach_storage_backend()


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
@pytest.mark.parametrize(("writer", "reader"), [(w, r) for w in PATHS for r in PATHS])
def test_mha_pages_cross_paths(layout, writer, reader, tmp_path) -> None:
    roundtrip(mha_pools, layout, writer, reader, tmp_path)


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
@pytest.mark.parametrize(("writer", "reader"), [("zero_copy", "generic"), ("generic", "zero_copy")])
def test_mla_pages_cross_paths(layout, writer, reader, tmp_path) -> None:
    roundtrip(mla_pools, layout, writer, reader, tmp_path)


def test_zero_copy_moves_no_staged_bytes(tmp_path) -> None:
    """The v1 path hands the pool's own memory to the backend: nothing is staged."""
    with zero_copy_controller("layer_first", 5, f"file://{tmp_path}") as (ctl, source):
        hashes = get_storage_hash_str(list(range(16)), None, page_size=PAGE)
        assert write_pages(ctl, "zero_copy", hashes, SOURCE_PAGES)
        assert read_pages(ctl, "zero_copy", hashes, TARGET_PAGES) == len(hashes)
        stats = ctl.storage_backend.backend_stats()
        assert stats["bytes_staged"] == 0
        assert stats["bytes_read"] >= len(hashes) * source[1].get_size_per_token() * PAGE


def test_a_missing_page_ends_the_read_there(tmp_path) -> None:
    with zero_copy_controller("page_first", 3, f"file://{tmp_path}") as (ctl, _):
        hashes = get_storage_hash_str(list(range(16)), None, page_size=PAGE)
        assert write_pages(ctl, "zero_copy", hashes[:2], SOURCE_PAGES[:2])
        assert ctl.storage_backend.batch_exists(hashes) == 2
        assert read_pages(ctl, "zero_copy", hashes, TARGET_PAGES) == 2
        assert read_pages(ctl, "generic", hashes, TARGET_PAGES) == 2


def test_bf16_and_fp32_pools_differ(tmp_path) -> None:
    """A dtype change is another namespace: the other pool's pages are not found."""
    bf16 = mha_pools("page_first", dtype=torch.bfloat16)
    fp32 = mha_pools("page_first", dtype=torch.float32)
    fill_random(bf16[1], seed=9)
    a = controller(bf16, f"file://{tmp_path}", zero_copy=True)
    b = controller(fp32, f"file://{tmp_path}", zero_copy=True)
    try:
        hashes = get_storage_hash_str(list(range(16)), None, page_size=PAGE)
        assert write_pages(a, "zero_copy", hashes, SOURCE_PAGES)
        assert a.storage_backend.batch_exists(hashes) == len(hashes)
        assert b.storage_backend.batch_exists(hashes) == 0
        assert read_pages(b, "zero_copy", hashes, TARGET_PAGES) == 0
    finally:
        a.detach_storage_backend()
        b.detach_storage_backend()


def test_pages_over_mooncake_move_without_a_copy(tmp_path) -> None:
    """With the pool and the adapter's header arena registered, Mooncake moves each page and
    its header straight between the pool and the store."""
    from hicache.tools.services.mooncake import mooncake_master

    with mooncake_master() as master:
        url = f"mooncake://{master.address}?metadata_server={master.metadata_url}"
        source = mha_pools("page_first")
        fill_random(source[1], seed=8)
        target = mha_pools("page_first")
        a = controller(source, url, zero_copy=True)
        b = controller(target, url, zero_copy=True)
        try:
            hashes = get_storage_hash_str(list(range(16)), None, page_size=PAGE)
            assert write_pages(a, "zero_copy", hashes, SOURCE_PAGES)
            assert read_pages(b, "zero_copy", hashes, TARGET_PAGES) == len(hashes)
            for src, dst in zip(SOURCE_PAGES, TARGET_PAGES, strict=True):
                assert page_bytes(target[1], dst * PAGE) == page_bytes(source[1], src * PAGE)
            for ctl in (a, b):
                stats = ctl.storage_backend.backend_stats()
                assert stats["bytes_staged"] == 0 and stats["zero_copy_bytes"] > 0
        finally:
            a.detach_storage_backend()
            b.detach_storage_backend()
