"""``hicache bench sglang``: SGLang's own controller page functions over the hicache adapter,
against SGLang's own storage backends on the same pages, in the same host layout.

``--backend disk`` (hicache's ``disk://``) and ``--backend file`` (``file://``) are compared with
SGLang's ``HiCacheFile``, ``--backend mooncake`` with SGLang's Mooncake store on the same master.
Both sides run inside a real ``HiCacheController`` built by SGLang: the adapter through SGLang's
``dynamic`` loader (zero-copy ``batch_set_v1`` / ``batch_get_v1``, every page checksummed on
write and checked on read), SGLang's ``HiCacheFile`` through its generic page functions and its
Mooncake store through its zero-copy ones, as SGLang picks them. Each round writes fresh pages
(new token ids) with each side, in alternating order, then reads them back into other host
slots; the bytes read are compared with the pages written once per side, outside the timing.
Throughputs are medians over the rounds; ``put_ratio`` and ``get_ratio`` are the median over
rounds of ours / SGLang's throughput in that round (the two ran back to back), so above 1 is
faster. For the file stores the page-cache floors run in the rotation
(:mod:`~hicache.tools.bench.engines.floor`: the same number of pages of the same size, each written
with one ``pwritev`` and read with one ``preadv``, by one thread and by as many as the machine
has): ``floor_N_put_ratio`` and ``floor_N_get_ratio`` are a floor's throughput over SGLang's in
each round, about the highest ratio a store that copies the pages through the page cache can
reach on the machine it ran on, and ``put_over_floor_N`` / ``get_over_floor_N`` ours over the
floor's. Before each side's put, :func:`~hicache.tools.bench.engines.floor.settle_memory`
hands every side the same memory state.
Runs only where SGLang is installed (the SGLang venv).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hicache.errors import ConfigError
from hicache.tools.bench.engines.floor import (
    PageCacheFloor,
    floor_figures,
    floor_sides,
    settle_memory,
)
from hicache.tools.bench.rounds import gb_s, rotated
from hicache.tools.cli_parsing import int_range

__all__ = ["add_bench_sglang_parser", "run_bench_sglang"]

# disk and file: ours over disk:// or file://, against SGLang's HiCacheFile; mooncake: ours
# and SGLang's Mooncake store on one master.
_BACKENDS = ("disk", "file", "mooncake")
_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
# Each client's share of the Mooncake cluster: room for every round's pages, so no round writes
# into a full segment (eviction would time that round, not the put path).
_SEGMENT_BYTES = 3 << 30
_LEASE_MS = 500
_NO_LF = "SGLang's Mooncake backend supports layer_first for MLA pools only"


@dataclass(frozen=True, slots=True)
class PageShape:
    layers: int
    heads: int
    head_dim: int
    page_size: int
    pages: int  # pages per batch of puts and gets (SGLang's batches hold at most 128)
    layout: str

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.heads * self.head_dim * self.page_size * 2  # K and V, bf16


def add_bench_sglang_parser(bench_sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "sglang", help="SGLang's page functions over the adapter vs SGLang's own backends"
    )
    p.add_argument(
        "--backend", action="append", choices=_BACKENDS, help="repeatable; both by default"
    )
    p.add_argument("--layout", choices=_LAYOUTS, default="page_first")
    p.add_argument("--layers", type=int_range(1, 256), default=8)
    p.add_argument("--heads", type=int_range(1, 256), default=8)
    p.add_argument("--head-dim", type=int_range(1, 1024), default=128)
    p.add_argument("--page-size", type=int_range(1, 1024), default=32)
    p.add_argument("--pages", type=int_range(1, 128), default=128)
    p.add_argument("--rounds", type=int_range(1, 100), default=5)
    p.add_argument("--dir", help="where the file stores go (default: a new temporary directory)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=run_bench_sglang)
    return p


def run_bench_sglang(args: argparse.Namespace) -> list[dict[str, Any]]:
    _require_sglang()
    shape = PageShape(
        args.layers, args.heads, args.head_dim, args.page_size, args.pages, args.layout
    )
    rows = []
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sglang-"))
        for number, backend in enumerate(args.backend or _BACKENDS):
            if backend == "mooncake" and shape.layout == "layer_first":
                # SGLang's Mooncake store raises for an MHA layer_first pool ("only supported
                # for MLA host KV pool"): there is nothing to compare with.
                rows.append({"backend": backend, "layout": shape.layout, "skipped": _NO_LF})
                continue
            # Stores of their own: a backend named twice would find the first one's pages
            # under the same keys (the rounds' token ids repeat) and skip writing them.
            where = os.path.join(root, f"comparison-{number}")
            os.makedirs(where, exist_ok=True)
            sides = stack.enter_context(_sides(backend, where, shape))
            rows.append(_compare(backend, sides, shape, args.rounds, where))
    return rows


def _require_sglang() -> None:
    try:
        import sglang.srt.managers.cache_controller  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"bench sglang needs SGLang ({exc}); run it from the SGLang venv: "
            "make .venv-sglang/.built && .venv-sglang/bin/hicache bench sglang"
        ) from None


@dataclass
class _Side:
    name: str
    sglang_controller: Any  # SGLang's HiCacheController (over our adapter or its store)
    host: Any
    zero_copy: bool


@contextlib.contextmanager
def _sides(backend: str, root: str, shape: PageShape) -> Iterator[tuple[_Side, _Side]]:
    """(ours, SGLang's) controllers over the same kind of store; detached at the end."""
    with contextlib.ExitStack() as stack:
        theirs_backend = "file" if backend in ("disk", "file") else backend
        if theirs_backend == "file":
            ours_url = f"{backend}://{os.path.join(root, 'hicache-' + backend)}"
            # A directory per comparison: HiCacheFile skips pages whose file exists.
            theirs_extra: dict[str, Any] = {
                "file_storage_path": os.path.join(root, f"sglang-{backend}")
            }
        else:
            from hicache.tools.services.mooncake import mooncake_master

            # A short lease: a page just read back can be removed at the end of its round.
            master = stack.enter_context(mooncake_master(lease_ttl_ms=_LEASE_MS))
            ours_url = (
                f"mooncake://{master.address}?metadata_server={master.metadata_url}"
                f"&global_segment_bytes={_SEGMENT_BYTES}"
            )
            stack.enter_context(_sglang_mooncake_env(master.address, master.metadata_url))
            theirs_extra = {}
        ours = _side("hicache", shape, "dynamic", _adapter_extra_config(ours_url))
        stack.callback(ours.sglang_controller.detach_storage_backend)
        theirs = _side("sglang", shape, theirs_backend, theirs_extra)
        stack.callback(theirs.sglang_controller.detach_storage_backend)
        yield ours, theirs


@contextlib.contextmanager
def _sglang_mooncake_env(master: str, metadata: str) -> Iterator[None]:
    """SGLang's Mooncake store reads its settings from the environment."""
    values = {
        "MOONCAKE_MASTER": master,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_DEVICE": "",
        "MOONCAKE_TE_META_DATA_SERVER": metadata,
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(_SEGMENT_BYTES),
    }
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _adapter_extra_config(url: str) -> dict[str, Any]:
    from hicache.integrations.sglang import extra_config

    return extra_config(url)


def _side(name: str, shape: PageShape, backend: str, extra: dict[str, Any]) -> _Side:
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    tokens = shape.pages * shape.page_size
    device = MHATokenToKVPool(
        size=tokens, page_size=shape.page_size, dtype=torch.bfloat16, head_num=shape.heads,
        head_dim=shape.head_dim, layer_num=shape.layers, device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    info = device.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(
        info, 2.0, 0, shape.page_size, shape.layout, pin_memory=False,
        device_capacity_tokens=tokens, start_layer=0, end_layer=shape.layers - 1,
    )  # fmt: skip
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8))
    allocator = TokenToKVPoolAllocator(
        size=tokens, dtype=torch.bfloat16, device="cpu", kvcache=device, need_sort=False
    )
    ranks = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    with get_parallel().override(**ranks):
        controller = HiCacheController(
            allocator, host, shape.page_size, None, threading.Event(), io_backend="direct",
            storage_backend=backend, model_name="bench/model", storage_backend_extra_config=extra,
        )  # fmt: skip
    zero_copy = controller.page_set_func.__name__ == "_page_set_zero_copy"
    return _Side(name, controller, host, zero_copy)


def _compare(
    backend: str, sides: tuple[_Side, _Side], shape: PageShape, rounds: int, root: str
) -> dict[str, Any]:
    from sglang.srt.managers.cache_controller import get_storage_hash_str

    by_name: dict[str, _Side | PageCacheFloor] = {s.name: s for s in sides}
    if backend != "mooncake":  # the page-cache floors: for the file stores only
        by_name.update(floor_sides(root, shape.pages, shape.page_bytes))
    timings: dict[str, dict[str, list[float]]] = {n: {"put": [], "get": []} for n in by_name}
    try:
        for round_no in range(rounds):
            for name in rotated(list(by_name), round_no):
                side = by_name[name]
                if isinstance(side, PageCacheFloor):
                    put_s, get_s = side.round_trip()
                else:
                    start = (round_no * 2 + (side.name == "sglang")) * 1_000_000
                    tokens = list(range(start, start + shape.pages * shape.page_size))
                    hashes = get_storage_hash_str(tokens, None, page_size=shape.page_size)
                    if backend != "mooncake":  # as the floors do: see floor.py
                        settle_memory(root, shape.pages * shape.page_bytes)
                    put_s, get_s = _round_trip(side, hashes, shape, check=round_no == 0)
                timings[name]["put"].append(put_s)
                timings[name]["get"].append(get_s)
            _end_round(backend, sides)
    finally:
        for side in by_name.values():
            if isinstance(side, PageCacheFloor):
                side.close()
    return _row(backend, shape, rounds, timings)


def _end_round(backend: str, sides: tuple[_Side, _Side]) -> None:
    if backend == "mooncake":
        # Empty the cluster (SGLang's clear is Mooncake's remove_all) once the reads'
        # leases are over: every round then writes into segment memory the store has used
        # before, as a store in service does, instead of timing first-touch page faults.
        time.sleep(1.2 * _LEASE_MS / 1000)
        sides[1].sglang_controller.storage_backend.clear()


def _row(
    backend: str, shape: PageShape, rounds: int, timings: dict[str, dict[str, list[float]]]
) -> dict[str, Any]:
    nbytes = shape.pages * shape.page_bytes
    row: dict[str, Any] = {"backend": backend, "layout": shape.layout, "pages": shape.pages,
                           "page_bytes": shape.page_bytes, "rounds": rounds}  # fmt: skip
    ours, theirs = timings["hicache"], timings["sglang"]
    for op in ("put", "get"):
        row[f"hicache_{op}_gb_s"] = gb_s(nbytes, ours[op])
        row[f"sglang_{op}_gb_s"] = gb_s(nbytes, theirs[op])
        # Each round's two sides ran back to back: their ratio cancels the machine's drift.
        paired = [t / o for o, t in zip(ours[op], theirs[op], strict=True)]
        row[f"{op}_ratio"] = round(statistics.median(paired), 3)
    row.update(floor_figures(timings, nbytes, "hicache", "sglang"))
    row["checksummed"] = True
    return row


def _round_trip(
    side: _Side, hashes: list[str], shape: PageShape, check: bool
) -> tuple[float, float]:
    """Put every page of the first half of the host pool, read them into the second half."""
    import torch
    from sglang.srt.managers.cache_controller import PrefetchOperation

    ctl, n, ps = side.sglang_controller, len(hashes), shape.page_size
    source = torch.arange(0, n * ps, dtype=torch.int64)
    target = torch.arange(n * ps, 2 * n * ps, dtype=torch.int64)
    stored = False

    def write() -> None:
        nonlocal stored
        stored = ctl.page_set_func(hashes, source)

    put_s = _timed(write)
    if not stored:
        raise RuntimeError(f"{side.name}: the put of {n} pages failed")
    operation = PrefetchOperation(f"bench-{side.name}", [])
    got = 0

    def read() -> None:
        nonlocal got
        got = ctl.page_get_func(operation, hashes, target)

    get_s = _timed(read)
    if got != n:
        raise RuntimeError(f"{side.name}: read {got} of {n} pages back")
    if check:
        _check_pages(side.host, n, ps)
    return put_s, get_s


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _check_pages(host: Any, pages: int, page_size: int) -> None:
    import torch

    for page in range(pages):
        written = host.get_data_page(page * page_size, flat=True).view(torch.uint8)
        read = host.get_data_page((pages + page) * page_size, flat=True).view(torch.uint8)
        if not torch.equal(written, read):  # as bytes: random bf16 bits include NaNs
            raise RuntimeError(f"page {page} read back differs from the page written")
