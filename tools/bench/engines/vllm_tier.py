"""``hicache bench vllm``: vLLM's secondary-tier API driven the same way over ``HiCacheTier``
(``disk://``) and over vLLM's own ``fs`` tier, in the same run.

Both tiers are built by vLLM's ``SecondaryTierFactory`` (:mod:`.vllm_sides`). Each round stores
``--chunks`` fresh chunks from the primary view, as jobs of ``--job-chunks`` (vLLM submits a job
per request and step), waits until every job has ended (``drain_jobs`` then
``get_finished_jobs``), then loads them all into other rows; the sides alternate which goes
first. The jobs of a round are submitted back to back, so a submit call also waits whenever the
tier's own threads hold the GIL: what vLLM's scheduler thread would wait. The bytes loaded are
compared with the bytes stored on the first round, outside the timing. The fs tier uses
``O_DIRECT`` where the filesystem takes it (its default: reported as ``fs_o_direct``);
``disk://`` writes through the page cache, as it does in service.

``store_ratio`` and ``load_ratio`` are ours over theirs in throughput (the median of the rounds'
ratios, with their range); ``*_cpu_us`` the process's CPU microseconds per chunk (the tier's
threads included), the median over rounds. ``submit_us_per_chunk`` is the scheduler thread's
time in one ``submit_store`` / ``submit_load`` call over its job's chunks: the median and the
90th percentile of all calls. The lookup figures come from a fresh process (one for both sides,
theirs first) over ``--lookup-keys`` keys stored beforehand (:mod:`.vllm_lookup`):
``lookup_time_ratio`` is ours over theirs in time (below 1: ours is faster) from building the
tier until every key is known; ``known_lookup_us`` the scheduler thread's time per lookup once
it is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from hicache.errors import ConfigError
from hicache.tools.bench.engines.vllm_lookup import fresh_lookup
from hicache.tools.bench.engines.vllm_sides import OURS, THEIRS, Side, TierShape, offload_keys
from hicache.tools.bench.engines.vllm_sides import tier_config as side_config
from hicache.tools.bench.rounds import paired_ratio, rotated
from hicache.tools.cli_parsing import check_memory, input_dir, int_range, size_range

__all__ = ["add_bench_vllm_parser", "run_bench_vllm"]

_LOOKUP_TAG = 1 << 20  # the lookup phase's keys: apart from every round's
_LOOKUP_BATCH = 1024  # lookup keys stored per batch (the fill's primary rows)
_LOOKUP_CHUNK = 4096  # the lookup phase's chunk size: what is timed does not read chunks


def add_bench_vllm_parser(bench_sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "vllm", help="vLLM's tier API over HiCacheTier vs vLLM's own fs tier"
    )
    p.add_argument("--chunk-bytes", type=size_range(4096, 64 << 20), default=64 << 10)
    p.add_argument("--chunks", type=int_range(1, 1 << 16), default=250, help="chunks per round")
    p.add_argument("--job-chunks", type=int_range(1, 1 << 16), default=4, help="chunks per job")
    p.add_argument(
        "--threads", type=int_range(1, 256), default=8, help="each side's read and write threads"
    )
    p.add_argument("--rounds", type=int_range(1, 1000), default=8)
    p.add_argument(
        "--lookup-keys", type=int_range(0, 1 << 20), default=10_000, help="0 skips the lookups"
    )
    p.add_argument("--dir", type=input_dir, help="where the stores go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=run_bench_vllm)
    return p


def run_bench_vllm(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row comparing the two sides."""
    shape = TierShape(args.chunk_bytes, args.chunks, args.job_chunks, args.threads)
    check_memory(4 * shape.chunks * shape.chunk_bytes, "--chunks x --chunk-bytes x 4")
    _require_vllm()
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vllm-"))
        for name in (OURS, THEIRS):
            if os.path.exists(os.path.join(root, name)):
                raise ConfigError(f"{os.path.join(root, name)} exists; give --dir an empty one")
        row = _rounds(root, shape, args.rounds)
        if args.lookup_keys:
            row.update(_lookups(root, shape.threads, args.lookup_keys))
        return [row]


def _require_vllm() -> None:
    try:
        import vllm.v1.kv_offload.tiering.fs.manager  # noqa: F401

        import hicache.integrations.vllm.tier  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"bench vllm needs vLLM ({exc}); run it from the vLLM venv: "
            "make .venv-vllm/.built && .venv-vllm/bin/hicache bench vllm"
        ) from None


@contextlib.contextmanager
def _sides(root: str, threads: int, chunk_bytes: int, rows: int) -> Iterator[dict[str, Side]]:
    sides: dict[str, Side] = {}
    try:
        for name in (OURS, THEIRS):
            sides[name] = Side(name, side_config(name, root, threads), chunk_bytes, rows)
        yield sides
    finally:
        for side in sides.values():
            side.close()


def _rounds(root: str, shape: TierShape, rounds: int) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {
        n: {"store": [], "load": [], "store_cpu": [], "load_cpu": [], "submit": []}
        for n in (OURS, THEIRS)
    }
    with _sides(root, shape.threads, shape.chunk_bytes, 2 * shape.chunks) as sides:
        rng = np.random.default_rng(0)
        for side in sides.values():
            side.primary[: shape.chunks] = rng.integers(0, 256, side.primary[: shape.chunks].shape)
        for r in range(rounds):
            keys = offload_keys(r, shape.chunks)
            for name in rotated([OURS, THEIRS], r):
                _one_round(sides[name], keys, shape, times[name], check=r == 0)
        o_direct = bool(getattr(sides[THEIRS].tier, "_use_o_direct", False))
    return _round_figures(shape, times, o_direct)


def _one_round(
    side: Side, keys: list[bytes], shape: TierShape, times: dict[str, list[float]], check: bool
) -> None:
    side.primary[shape.chunks :] = 0
    stored = side.transfer(keys, 0, shape.job_chunks, load=False)
    loaded = side.transfer(keys, shape.chunks, shape.job_chunks, load=True)
    if check and not np.array_equal(side.primary[shape.chunks :], side.primary[: shape.chunks]):
        raise RuntimeError(f"{side.name}: the chunks loaded differ from the chunks stored")
    for op, done in (("store", stored), ("load", loaded)):
        times[op].append(done.seconds)
        times[f"{op}_cpu"].append(done.cpu_seconds / len(keys) * 1e6)
        times["submit"].extend(done.submit_us)


def _round_figures(
    shape: TierShape, times: dict[str, dict[str, list[float]]], o_direct: bool
) -> dict[str, Any]:
    nbytes = shape.chunks * shape.chunk_bytes
    row: dict[str, Any] = {
        "chunk_bytes": shape.chunk_bytes,
        "chunks": shape.chunks,
        "job_chunks": shape.job_chunks,
        "fs_o_direct": o_direct,
    }
    for name in (OURS, THEIRS):
        for op in ("store", "load"):
            row[f"{name}_{op}_gbps"] = round(nbytes / statistics.median(times[name][op]) / 1e9, 3)
            row[f"{name}_{op}_cpu_us"] = round(statistics.median(times[name][f"{op}_cpu"]), 1)
        calls = sorted(times[name]["submit"])
        row[f"{name}_submit_us_per_chunk"] = round(statistics.median(calls), 2)
        row[f"{name}_submit_us_per_chunk_p90"] = round(calls[int(0.9 * (len(calls) - 1))], 2)
        row[f"{name}_submit_calls"] = len(calls)
    for op in ("store", "load"):
        row.update(paired_ratio(f"{op}_ratio", times[OURS][op], times[THEIRS][op]))
    return row


def _lookups(root: str, threads: int, count: int) -> dict[str, Any]:
    """Store ``count`` keys on each side, then time a fresh process looking them all up."""
    keys = offload_keys(_LOOKUP_TAG, count)
    lookup_root = os.path.join(root, "lookup")
    with _sides(lookup_root, threads, _LOOKUP_CHUNK, _LOOKUP_BATCH) as sides:
        for side in sides.values():
            for at in range(0, count, _LOOKUP_BATCH):
                batch = keys[at : at + _LOOKUP_BATCH]
                side.transfer(batch, 0, _LOOKUP_BATCH, load=False)
    configs = {name: side_config(name, lookup_root, threads) for name in (THEIRS, OURS)}
    found = fresh_lookup(configs, _LOOKUP_TAG, count)
    row: dict[str, Any] = {"lookup_keys": count}
    for name, figures in found.items():
        if figures["hits"] != count:
            raise RuntimeError(f"{name}: {figures['hits']} of {count} stored keys hit")
        row[f"{name}_lookup_open_s"] = round(figures["open_s"], 4)
        row[f"{name}_lookup_total_s"] = round(figures["total_s"], 4)
        row[f"{name}_lookup_steps"] = figures["steps"]
        row[f"{name}_known_lookup_us"] = round(figures["known_lookup_us"], 3)
    row["lookup_time_ratio"] = round(found[OURS]["total_s"] / found[THEIRS]["total_s"], 3)
    return row
