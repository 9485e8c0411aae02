"""``hicache bench lmcache``: LMCache's own storage code writing and reading the same chunks
through the hicache plugin over ``disk://`` and through LMCache's own ``LocalDiskBackend``.

Both sides are a ``StorageManager`` that LMCache 0.5.6 builds from an ``LMCacheEngineConfig``,
the same configuration but for the storage tier: ours loads the hicache remote-storage plugin
(the README's settings) with ``disk://DIR/hicache``; theirs sets ``local_disk: DIR/lmcache``
and a ``max_local_disk_size`` with room for every round's chunks (no put evicts), so that
LMCache's ``CreateStorageBackends`` builds its ``LocalDiskBackend`` as in service (its default
4 I/O threads). The ``StorageManager`` is what ``LMCacheEngine`` calls (``store`` ->
``batched_put``, ``retrieve`` -> ``batched_get`` at the tier its lookup found) and the lowest
layer over both tiers: the timed calls run LMCache's dispatch and CPU allocator on both sides,
its ``RemoteBackend`` and plugin connector on ours, its disk backend's thread pools on theirs.
LMCache's CPU hot cache is off on both (``local_cpu: false``; chunks are still allocated from
its CPU buffer), so every get reads the store rather than a copy LMCache kept.

Each round puts fresh chunks (new keys) with each side, in alternating order, then gets them
all back. ``batched_put`` returns at once on both sides (LMCache writes in the background: on
its storage loop for ours, on the disk backend's I/O threads for theirs), so the put is timed
until LMCache's own lookup (``batched_contains`` on that tier, polled every 0.5 ms) finds
every chunk: theirs once every chunk's file is written and in its index, ours once the disk
store's put returned. Neither syncs (LMCache never fsyncs; ``disk://`` does only with
``fsync=true``), so both write to the page cache, and gets read what the page cache holds. The
get is ``batched_get(keys, location=tier)`` until every chunk is in an LMCache memory object.
The bytes read are compared with the bytes written once per side (the first round, whose
reads land in memory no chunk was written from), outside the timing.
Throughputs are medians over rounds; ``put_ratio`` and ``get_ratio`` are the median over
rounds of ours / LMCache's throughput in that round (above 1: ours is faster), with their
range. The page-cache floors run in the same rotation (:mod:`~hicache.tools.bench.engines.floor`: as
many chunks of the same size, each written with one ``pwritev`` and read with one ``preadv``,
by one thread and by as many as the machine has): ``floor_N_put_ratio`` and
``floor_N_get_ratio`` are a floor's throughput over LMCache's in each round, about the highest
ratio a store that copies the chunks through the page cache can reach on the machine it ran
on, and ``put_over_floor_N`` / ``get_over_floor_N`` ours over the floor's. Before each side's
put, :func:`~hicache.tools.bench.engines.floor.settle_memory` hands every side the same memory
state.
With ``--remote redis`` (or ``redis-cluster``) both sides store in a ``redis-server`` (or a
3-master cluster) the run starts, through the plugin over ``redis://`` and LMCache's own Redis
connector, both behind LMCache's ``RemoteBackend``
(:mod:`~hicache.tools.bench.engines.lmcache_stores`); no page-cache floor runs.
Runs only where LMCache is installed (the LMCache venv).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hicache.errors import ConfigError
from hicache.tools.bench.engines.floor import floor_figures, floor_sides, settle_memory
from hicache.tools.bench.engines.lmcache_stores import (
    OURS,
    THEIRS,
    Store,
    disk_store,
    drain_redis_connector,
    redis_store,
)
from hicache.tools.bench.rounds import gb_s, paired_ratio, rotated
from hicache.tools.cli_parsing import check_disk, check_memory, input_dir, int_range

__all__ = ["ChunkShape", "add_bench_lmcache_parser", "run_bench_lmcache"]

_MODEL = "bench/model"
_POLL_S = 0.0005
_STORED_TIMEOUT_S = 300.0
# Room in LMCache's CPU buffer beyond the chunks a round holds at once (its allocator rounds
# each chunk up to its alignment; tiny test chunks would not fit otherwise).
_ALLOC_ALIGN = 64 << 10
_SEGMENT_SLACK = 2 * (256 << 20)  # disk:// preallocates its open segments


@dataclass(frozen=True, slots=True)
class ChunkShape:
    """One LMCache chunk of bf16 KV (LMCache's KV_2LTD: K and V, layers, tokens, hidden)."""

    layers: int
    heads: int
    head_dim: int
    tokens: int
    chunks: int  # chunks per round, put in one call and got in one call

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * self.head_dim * 2

    @property
    def round_bytes(self) -> int:
        return self.chunks * self.chunk_bytes


def add_bench_lmcache_parser(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench lmcache``; its defaults are a Llama-3.2-1B-sized KV (16 layers, 8 KV
    heads of 64) in LMCache's default 256-token chunks, 64 chunks (a 16k-token prompt)."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "lmcache", help="LMCache's storage manager over the plugin vs LMCache's local disk"
    )
    p.add_argument("--chunks", type=int_range(1, 4096), default=64, help="chunks per round")
    p.add_argument("--chunk-tokens", type=int_range(1, 4096), default=256)
    p.add_argument("--layers", type=int_range(1, 256), default=16)
    p.add_argument("--heads", type=int_range(1, 256), default=8, help="KV heads")
    p.add_argument("--head-dim", type=int_range(1, 1024), default=64)
    p.add_argument(
        "--rounds",
        type=int_range(1, 100),
        default=6,
        help="rounds (an even number puts each side first equally often)",
    )
    p.add_argument(
        "--dir", type=input_dir, help="where the two stores go (default: a temporary directory)"
    )
    p.add_argument(
        "--remote",
        choices=["redis", "redis-cluster"],
        help="compare over a redis-server (or a 3-master Redis Cluster) the run starts: the "
        "plugin over redis:// against LMCache's own redis connector, instead of over a disk",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=run_bench_lmcache)
    return p


def run_bench_lmcache(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row: both sides over ``args.rounds`` rounds of ``args.chunks`` chunks."""
    shape = ChunkShape(args.layers, args.heads, args.head_dim, args.chunk_tokens, args.chunks)
    # Two CPU buffers of two rounds' chunks each, the chunks' source bytes, and the two
    # floors' sources and targets.
    check_memory(9 * shape.round_bytes, "--chunks x the chunk's size x 9")
    _require_lmcache()
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-lmc-"))
        if args.remote is not None:
            store = stack.enter_context(redis_store(root, args.remote == "redis-cluster"))
        else:
            _check_room(root, shape, args.rounds)
            store = disk_store(root, shape.round_bytes, args.rounds)
        sides = stack.enter_context(_sides(store, shape))
        return [_compare(sides, shape, args.rounds, store)]


def _require_lmcache() -> None:
    # LMCache logs each backend's setup and shutdown at INFO; its level is read at import.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        import lmcache.v1.storage_backend.storage_manager  # noqa: F401

        import hicache.integrations.lmcache  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"bench lmcache needs LMCache ({exc}); run it from the LMCache venv: "
            "make .venv-lmcache/.built && .venv-lmcache/bin/hicache bench lmcache"
        ) from None


def _check_room(root: str, shape: ChunkShape, rounds: int) -> None:
    """Refuse stores left by an earlier run (their keys could collide), or too little disk."""
    for name in (OURS, THEIRS):
        path = os.path.join(root, name)
        if os.path.exists(path):
            raise ConfigError(f"{path} exists; give --dir a directory without it")
    need = 4 * rounds * shape.round_bytes + _SEGMENT_SLACK
    what = "the two stores and the floors"
    check_disk(root, need, what, "there", "lower --chunks, --rounds or the chunk's shape")


@dataclass(frozen=True, slots=True)
class _Side:
    name: str
    manager: Any  # LMCache's StorageManager
    tier: str  # the name LMCache gives the backend under test


@contextlib.contextmanager
def _sides(store: Store, shape: ChunkShape) -> Iterator[tuple[_Side, _Side]]:
    """(ours, LMCache's) storage managers, built by LMCache from their configs; closed after."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    with contextlib.ExitStack() as stack:
        sides = []
        for name in (OURS, THEIRS):
            config = _config(shape, store.fields[name])
            manager = StorageManager(config, _metadata(shape), EventManager())
            stack.callback(manager.close)
            if store.tiers[name] not in manager.storage_backends:
                raise RuntimeError(f"LMCache did not build {store.tiers[name]} (see its log above)")
            if store.tiers[name].startswith("RemoteBackend") and name == THEIRS:
                stack.callback(drain_redis_connector, manager.storage_backends[store.tiers[name]])
            sides.append(_Side(name, manager, store.tiers[name]))
        yield sides[0], sides[1]


def _config(shape: ChunkShape, tier_fields: dict[str, Any]) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    # Room for the chunks being put and the chunks being got (a put's memory objects may be
    # released just after LMCache's lookup finds them).
    slot = -(-shape.chunk_bytes // _ALLOC_ALIGN) * _ALLOC_ALIGN
    cpu_gib = (2 * shape.chunks + 4) * slot / 2**30
    fields = {"chunk_size": shape.tokens, "local_cpu": False, "max_local_cpu_size": cpu_gib}
    return LMCacheEngineConfig.from_defaults(**fields, **tier_fields)


def _metadata(shape: ChunkShape) -> Any:
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=_MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(shape.layers, 2, shape.tokens, shape.heads, shape.head_dim),
        chunk_size=shape.tokens,
    )


def _compare(
    sides: tuple[_Side, _Side], shape: ChunkShape, rounds: int, store: Store
) -> dict[str, Any]:
    import torch

    # Random bytes (as bf16 they include NaNs: compared as bytes); each chunk its own.
    source = torch.randint(0, 256, (shape.chunks, shape.chunk_bytes), dtype=torch.uint8)
    by_name = {side.name: side for side in sides}
    root = store.root
    floors = floor_sides(root, shape.chunks, shape.chunk_bytes) if store.floors else {}
    names = [OURS, THEIRS, *floors]
    timings: dict[str, dict[str, list[float]]] = {n: {"put": [], "get": []} for n in names}
    try:
        for round_no in range(rounds):
            for name in rotated(names, round_no):
                if name in floors:
                    put_s, get_s = floors[name].round_trip()
                else:
                    keys = _keys(round_no, name == THEIRS, shape.chunks)
                    settle_memory(root, shape.round_bytes)  # as the floors do: see floor.py
                    put_s, get_s = _round_trip(by_name[name], keys, source, round_no == 0)
                    store.after_round()
                timings[name]["put"].append(put_s)
                timings[name]["get"].append(get_s)
    finally:
        for floor in floors.values():
            floor.close()
    row: dict[str, Any] = {
        "chunks": shape.chunks, "chunk_tokens": shape.tokens, "layers": shape.layers,
        "heads": shape.heads, "head_dim": shape.head_dim, "dtype": "bfloat16",
        "chunk_bytes": shape.chunk_bytes, "rounds": rounds, "lmcache_tier": store.tiers[THEIRS],
    }  # fmt: skip
    ours, theirs = timings[OURS], timings[THEIRS]
    for op in ("put", "get"):
        row[f"hicache_{op}_gb_s"] = gb_s(shape.round_bytes, ours[op])
        row[f"lmcache_{op}_gb_s"] = gb_s(shape.round_bytes, theirs[op])
        row.update(paired_ratio(f"{op}_ratio", ours[op], theirs[op]))
    row.update(floor_figures(timings, shape.round_bytes, OURS, THEIRS))
    row["checked"] = True
    return row


def _keys(round_no: int, theirs: bool, chunks: int) -> list[Any]:
    """Keys no earlier round (of either side) used, as LMCache's token database makes them."""
    import torch
    from lmcache.utils import CacheEngineKey

    base = (2 * round_no + int(theirs)) << 32
    return [CacheEngineKey(_MODEL, 1, 0, base + i, torch.bfloat16) for i in range(chunks)]


def _round_trip(side: _Side, keys: list[Any], source: Any, check: bool) -> tuple[float, float]:
    """Put every chunk, wait until stored, get them all back: (put, get) seconds."""
    manager, n = side.manager, len(keys)
    objs = [_filled(manager, row) for row in source]  # untimed, as the engine's copy from GPU
    for obj in objs:
        # Kept until the get is over: LMCache releases the objects a put was given, and the
        # get's would then take their memory, which already holds the bytes to be checked.
        obj.ref_count_up()
    started = time.perf_counter()
    manager.batched_put(keys, objs)
    _wait_stored(side, keys)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    got = manager.batched_get(keys, location=side.tier)
    get_s = time.perf_counter() - started
    for obj in objs:
        obj.ref_count_down()
    try:
        found = sum(obj is not None for obj in got)
        if found != n:
            raise RuntimeError(f"{side.name}: got {found} of {n} chunks back")
        if check:
            _check(side.name, got, source)
    finally:
        for obj in got:
            if obj is not None:
                obj.ref_count_down()
    return put_s, get_s


def _filled(manager: Any, data: Any) -> Any:
    """A memory object from LMCache's allocator holding ``data`` (one chunk's bytes)."""
    metadata = manager.metadata
    obj = manager.allocate(metadata.get_shapes(), metadata.get_dtypes())
    if obj is None:
        raise RuntimeError("LMCache's CPU buffer has no room for a chunk")
    _as_bytes(obj).copy_(data)
    return obj


def _as_bytes(obj: Any) -> Any:
    import torch

    return obj.tensor.view(torch.uint8).reshape(-1)


def _wait_stored(side: _Side, keys: list[Any]) -> None:
    """Until LMCache's lookup on the side's tier finds every key (its writes are async)."""
    deadline = time.monotonic() + _STORED_TIMEOUT_S
    while side.manager.batched_contains(keys, search_range=[side.tier])[0] != len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{side.name}: the chunks were not stored within {_STORED_TIMEOUT_S:g} s"
            )
        time.sleep(_POLL_S)


def _check(name: str, got: list[Any], source: Any) -> None:
    import torch

    for index, obj in enumerate(got):
        if not torch.equal(_as_bytes(obj), source[index]):
            raise RuntimeError(f"{name}: chunk {index} read back differs from the one written")
