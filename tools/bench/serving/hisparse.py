"""``hicache bench hisparse``: long-context decode at a fixed device memory budget, with and
without the HiSparse hot buffer, at a low and a high concurrency.

A DSA model (the ``dsa`` preset's layers) serves ``concurrency`` requests arriving at once, each
a distinct prompt of ``--context`` tokens generating ``--output-tokens``. The device budget is
``--budget-contexts`` whole contexts of the anchor pool (latent and indexer keys per token):

* without HiSparse the anchor pool is the whole budget, and a request holds its context there
  from admission to finish, so ``running_max`` is how many contexts fit;
* with HiSparse the anchor pool holds one prompt (prefill runs one request at a time there) and
  the rest of the budget is hot buffer rows: ``--hot-pages`` pages of latent per layer plus the
  whole context's indexer keys per request; the latent lives in host memory.

``decode_tok_s`` counts the steps at full occupancy: ``min(concurrency, running_max)``
requests decoding and none prefilling, as tokens over those steps' wall time. So the figure is
decode throughput at the concurrency the budget allows, and the prompts' prefill (the same work
in both runs, one prompt at a time in HiSparse's anchor pool) is left out; the outputs must be
long enough for every admitted request to be decoding at once (``decode_steps`` counts them).
The HiSparse run goes twice: with its host-to-device copies overlapped with the forward (a copy
thread on the CPU, a side stream on CUDA: :mod:`hicache.sparse.hot_copies`) and with them run
synchronously, in the forward's thread. Each HiSparse row reports ``copy_s`` (the copies' own
time), ``copy_waited_s`` (the forward's time blocked on them; on CUDA a stream wait the host
does not see, reported as null) and ``copy_hidden`` (``1 - copy_waited_s / copy_s``; 0 for the
synchronous run by construction). All runs of a concurrency serve the same prompts, and
``outputs_identical`` says whether they generated the same tokens. ``throughput_ratio`` is the
high-concurrency point's with (overlapped copies) / without; ``low_concurrency_ratio`` the low
one's; ``overlap_vs_sync`` the high point's overlapped / synchronous decode tok/s, and
``copy_hidden`` its overlapped run's hidden fraction.

The runs of one concurrency share an L3 (``file://`` in a temporary directory, removed after):
the first run computes the prompts and writes them through, the later ones read them back
instead of computing them again. Prefill is not in the figures; sharing it keeps a long
context's bench to one prefill (the DSA indexer's prefill grows with the square of the
context) and gives every run the same bytes to decode from.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
from typing import Any

import torch

from hicache.errors import ConfigError
from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.tiny import TinyTransformer
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.request import RequestRecord, StepRecord
from hicache.serving.setup import open_engine, resolve_device
from hicache.sparse.hot_buffer import HiSparseConfig
from hicache.sparse.hot_copies import CopyMode, CopyTimes
from hicache.tiering.common.config import HiCacheConfig, StorageConfig, TierConfig
from hicache.tools.cli_parsing import check_memory, int_range
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.traces import TraceRequest

__all__ = ["add_bench_hisparse_parser", "run_bench_hisparse"]

_CHUNK = 1024  # prefill chunk tokens


def add_bench_hisparse_parser(bench_sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "hisparse", help="long-context decode at a fixed device budget, with and without HiSparse"
    )
    p.add_argument("--context", type=int_range(256, 1 << 17), default=8192, help="prompt tokens")
    p.add_argument("--output-tokens", type=int_range(2, 1 << 14), default=256)
    p.add_argument("--low", type=int_range(1, 256), default=2, help="the low concurrency")
    p.add_argument("--high", type=int_range(1, 256), default=16, help="the high concurrency")
    p.add_argument(
        "--budget-contexts",
        type=int_range(1, 64),
        default=4,
        help="device memory: this many contexts of the anchor pool",
    )
    p.add_argument("--hot-pages", type=int_range(1, 4096), default=8)
    p.add_argument("--topk", type=int_range(1, 1024), default=4, help="pages per query")
    p.add_argument("--page-size", type=int_range(1, 4096), default=64)
    p.add_argument("--seed", type=int_range(0, 1 << 31), default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(bench_run=run_bench_hisparse)
    return p


@dataclasses.dataclass(frozen=True, slots=True)
class _Sizes:
    """Device sizes of one run at the budget."""

    device_tokens: int  # anchor pool
    max_running: int
    index_tokens: int  # HiSparse indexer slots (0 without)


def _model(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        preset=ModelPreset.DSA, vocab_size=4096, hidden=128, layers=4, heads=4, kv_heads=4,
        head_dim=32, page_size=args.page_size, latent_dim=32, index_dim=16,
        index_topk_pages=args.topk, seed=args.seed,
    )  # fmt: skip


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _sizes(args: argparse.Namespace, model: ModelConfig, hisparse: bool, wanted: int) -> _Sizes:
    """What fits the budget: whole contexts without HiSparse; one prompt and hot rows with."""
    ps, layers = model.page_size, model.layers
    latent_b, index_b = model.latent_dim * 4, model.index_dim + 4
    context = _pages(args.context + args.output_tokens, ps) * ps
    budget = args.budget_contexts * context * (latent_b + index_b) * layers
    if not hisparse:
        tokens = budget // ((latent_b + index_b) * layers) // ps * ps
        return _Sizes(tokens, max(1, min(wanted, tokens // context)), 0)
    prompt = _pages(args.context, ps) * ps
    left = budget - prompt * (latent_b + index_b) * layers
    row = layers * (args.hot_pages * ps * latent_b + context * index_b + 2 * args.hot_pages * 8)
    rows = max(1, min(wanted, left // row))
    return _Sizes(prompt, rows, rows * context)


def _trace(args: argparse.Namespace, count: int, vocab: int) -> list[TraceRequest]:
    gen = torch.Generator().manual_seed(args.seed)
    return [
        TraceRequest(
            f"r{i}", "", torch.randint(0, vocab, (args.context,), generator=gen).tolist(),
            [0] * args.output_tokens,
        )
        for i in range(count)
    ]  # fmt: skip


async def _run(
    args: argparse.Namespace,
    model: TinyTransformer,
    concurrency: int,
    copies: CopyMode | None,
    l3_url: str,
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """One run; ``copies`` None: without HiSparse. ``l3_url``: the L3 the runs of one
    concurrency share."""
    config = model.config
    hisparse = copies is not None
    sizes = _sizes(args, config, hisparse, concurrency)
    context_pages = _pages(args.context + args.output_tokens, config.page_size)
    host = TierConfig(host_pages=(concurrency + 2) * context_pages)
    sparse = HiSparseConfig(args.hot_pages, sizes.index_tokens, copies) if copies else None
    engine_config = EngineConfig(
        max_running=sizes.max_running, chunk_tokens=_CHUNK, hisparse=sparse, stall_s=600.0
    )
    hicache = HiCacheConfig(tiers=host, storage=StorageConfig(url=l3_url))
    setup = await open_engine(
        model, CacheMode.DEVICE_HOST_L3, hicache, sizes.device_tokens, engine_config
    )
    steps: list[StepRecord] = []
    setup.engine.observe(steps.append, StepRecord)
    source = TraceReplay(_trace(args, concurrency, config.vocab_size))
    outputs: dict[str, list[int]] = {}

    def finished(request: Any, now: float) -> None:
        if request.record.error is None:
            outputs[request.rid] = list(request.generated)

    source.finished = finished  # type: ignore[method-assign]
    try:
        records = await setup.engine.run(source)
        hot = setup.engine.sparse
        times = dataclasses.replace(hot.buffer.copy_times) if hot is not None else None
    finally:
        await setup.close()
    row = _row(setup, concurrency, sizes, steps, records)
    return {**row, **_copy_fields(copies, times)}, outputs


def _copy_fields(copies: CopyMode | None, times: CopyTimes | None) -> dict[str, Any]:
    if copies is None or times is None:
        return {"copies": None}
    hidden = times.hidden
    return {
        "copies": copies.value,
        "copy_s": round(times.copy_s, 4),
        "copy_waited_s": round(times.waited_s, 4) if times.host_waits else None,
        "copy_hidden": round(hidden, 3) if hidden is not None else None,
    }


def _row(
    setup: Any,
    concurrency: int,
    sizes: _Sizes,
    steps: list[StepRecord],
    records: list[RequestRecord],
) -> dict[str, Any]:
    full = min(concurrency, sizes.max_running)
    decode = [s for s in steps if s.prefill_tokens == 0 and s.decode_tokens == full]
    tokens, seconds = sum(s.decode_tokens for s in decode), sum(s.seconds for s in decode)
    anchor_bytes = sum(
        p.buffer.numel() * p.buffer.element_size() for p in setup.engine.pools.values()
    )
    sparse = setup.engine.sparse
    stats = sparse.buffer.stats if sparse is not None else None
    return {
        "concurrency": concurrency,
        "hisparse": sparse is not None,
        "running_max": sizes.max_running,
        "running_seen": max((s.decode_tokens for s in steps), default=0),
        "decode_tok_s": round(tokens / seconds, 1) if seconds else 0.0,
        "decode_steps": len(decode),
        "miss_rate": round(stats.miss_rate, 4) if stats else 0.0,
        "h2d_bytes_per_token": round(stats.h2d_bytes / stats.decode_rows)
        if stats and stats.decode_rows
        else 0,
        "device_bytes": anchor_bytes + (sparse.buffer.device_bytes if sparse else 0),
        "failed": sum(1 for r in records if r.error is not None),
        "computed_tokens": sum(r.computed_tokens for r in records),  # the rest read back
    }


def run_bench_hisparse(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = _model(args)
    check_memory(_host_bytes(args, config), "bench hisparse")
    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    model = TinyTransformer(config, device)
    rows: list[dict[str, Any]] = []
    identical = True
    for concurrency in dict.fromkeys((args.low, args.high)):
        with tempfile.TemporaryDirectory(prefix="hicache-bench-hisparse-") as l3:
            url = f"file://{l3}"
            without, out_without = asyncio.run(_run(args, model, concurrency, None, url))
            overlap, out_overlap = asyncio.run(
                _run(args, model, concurrency, CopyMode.OVERLAP, url)
            )
            sync, out_sync = asyncio.run(_run(args, model, concurrency, CopyMode.SYNC, url))
        rows += [without, overlap, sync]
        same = out_without == out_overlap == out_sync
        identical &= same and len(out_overlap) == concurrency

    def tok_s(concurrency: int, copies: CopyMode | None) -> float:
        value = copies.value if copies is not None else None
        row = next(r for r in rows if r["concurrency"] == concurrency and r["copies"] == value)
        return float(row["decode_tok_s"])

    def ratio(concurrency: int, copies: CopyMode | None = None) -> float:
        base = tok_s(concurrency, copies)
        return round(tok_s(concurrency, CopyMode.OVERLAP) / base, 3) if base else 0.0

    high = next(r for r in rows if r["concurrency"] == args.high and r["copies"] == "overlap")
    rows.append(
        {
            "summary": True,
            "throughput_ratio": ratio(args.high),
            "low_concurrency_ratio": ratio(args.low),
            "overlap_vs_sync": ratio(args.high, CopyMode.SYNC),
            "copy_hidden": high["copy_hidden"],
            "outputs_identical": identical,
            "context": args.context,
            "output_tokens": args.output_tokens,
            "budget_contexts": args.budget_contexts,
            "hot_pages": args.hot_pages,
            "topk": args.topk,
        }
    )
    return rows


def _host_bytes(args: argparse.Namespace, config: ModelConfig) -> int:
    """Host memory the largest run takes: host pool, model weights and a chunk's scratch."""
    context = args.context + args.output_tokens
    per_token = (config.latent_dim * 4 + config.index_dim + 4) * config.layers
    host = (args.high + 2) * (context + config.page_size) * per_token
    scratch = _CHUNK * context * 8 * 2
    return int(3 * host + scratch + (64 << 20))
