"""``hicache serve``: the serving loop over the tiered cache, with L3 on by default.

The default workload is multi-turn chat sized so that its working set is at least 4 times the
device pool and 1.5 times the host pool, so every tier is exercised. ``--compare`` runs the same
requests with no cache, device only, device + host and device + host + L3, and checks that every
configuration generated exactly the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any

from hicache.backends.wrappers import LatencyBackend, LatencyConfig
from hicache.errors import BackendError, InvalidArgumentError
from hicache.models.hf.loader import CheckpointPlan
from hicache.models.hf.tokenizer import load_tokenizer
from hicache.models.tiny import TinyTransformer
from hicache.models.types import ServingModel
from hicache.scheduling.host_weight import DEFAULT_HOST_HIT_WEIGHT
from hicache.scheduling.scheduler import SchedulePolicy
from hicache.serving.engine import CacheMode
from hicache.serving.setup import host_pages, open_engine
from hicache.tiering.common.config import HiCacheConfig
from hicache.tools.cli_parsing import (
    CommandFailed,
    arg_type,
    float_range,
    int_range,
    output_file,
    path_arg,
)
from hicache.tools.config_flags import add_hicache_flags
from hicache.tools.serve.config import (
    add_hisparse_flags,
    add_policy_flags,
    checked_model,
    engine_config_of,
    hicache_config,
    hisparse_config,
    l3_namespace,
    write_outputs,
)
from hicache.tools.serve.online import add_online_flags, run_online
from hicache.tools.serve.serve_flags import add_model_and_workload_flags, plot_file
from hicache.urls import redact_url
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.pool_report import pool_bytes
from hicache.workloads.report import config_row, oracle_hit_rate, print_table
from hicache.workloads.synthetic import (
    ChatConfig,
    MultiTurnChat,
    SharedPrefixConfig,
    shared_prefix_trace,
)
from hicache.workloads.traces import TraceRequest, load_trace, tokenize_trace

__all__ = ["add_serve_parser", "run_serve"]

# The default L3 is a disk:// store here. Its own folder: file:// stores kept their pages under
# .../hicache/l3 before, and a disk store refuses a folder that holds something else.
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hicache", "disk")


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="serve a workload with the tiered cache (L3 on local disk by default)"
    )
    add_model_and_workload_flags(p)
    e = p.add_argument_group("engine")
    e.add_argument(
        "--device-tokens", type=int_range(1, 1 << 30), default=4608, help="device pool, in tokens"
    )
    e.add_argument("--max-running", type=int_range(1, 4096), default=4)
    e.add_argument("--chunk-tokens", type=int_range(1, 1 << 20), default=512)
    e.add_argument("--schedule", choices=[x.value for x in SchedulePolicy], default="lpm")
    e.add_argument(
        "--host-hit-weight",
        type=float_range(0, 1),
        default=DEFAULT_HOST_HIT_WEIGHT,
        help="what a prefix token cached on host is worth against one on the device, to LPM, "
        "DFS_WEIGHT and the cache-aware router: 1 counts it as a device hit, 0 as a miss",
    )
    e.add_argument("--temperature", type=float_range(0, 1000), default=0.0, help="0: greedy")
    e.add_argument(
        "--no-prefetch-skip",
        action="store_true",
        help="prefetch from L3 even when the measured rates say computing is faster",
    )
    add_policy_flags(e)
    add_hisparse_flags(e)
    e.add_argument(
        "--l3-warm",
        action="store_true",
        help="use the model's shared L3 namespace: read what earlier --l3-warm runs wrote "
        "(default: an empty namespace of the run's own, so runs are reproducible)",
    )
    e.add_argument(
        "--cache-dir",
        type=path_arg,
        default=DEFAULT_CACHE_DIR,
        help="where the default L3 (a disk:// store) lives",
    )
    e.add_argument(
        "--l3-bandwidth",
        type=float_range(0, 1e6, low_open=True),
        help="limit L3 to this many MB/s each way (a slow-L3 demo)",
    )
    add_hicache_flags(p)
    add_online_flags(p)
    o = p.add_argument_group("output")
    o.add_argument("--compare", action="store_true", help="also run none/device/device+host")
    o.add_argument("--json", action="store_true", help="one JSON object")
    o.add_argument(
        "--plot",
        type=arg_type(plot_file),
        help="write TTFT per round per configuration to this file (.png, .svg or .pdf)",
    )
    o.add_argument(
        "--dump-outputs",
        type=output_file,
        help="write each request's generated tokens as JSON lines {id, output_tokens} (of the "
        "last configuration run)",
    )
    o.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=run_serve)
    return p


def _load_trace(args: argparse.Namespace, plan: CheckpointPlan | None) -> list[TraceRequest] | None:
    """The ``--trace`` requests, read once for every configuration, text prompts encoded with
    the checkpoint's tokenizer when it has one; None without a trace."""
    if not args.trace:
        return None
    requests = load_trace(args.trace)
    if not requests:
        raise InvalidArgumentError(f"trace {args.trace} holds no requests")
    if plan is not None:
        tokenizer = load_tokenizer(plan.directory)
        requests = tokenize_trace(requests, tokenizer, plan.config.vocab_size)
    return requests


def _source(args: argparse.Namespace, vocab: int, trace: list[TraceRequest] | None) -> Any:
    if trace is not None:
        return TraceReplay(trace, args.rate, args.seed)
    if args.workload != "chat":
        fewshot = args.workload == "fewshot"
        shared = SharedPrefixConfig(
            requests=args.clients * args.rounds,
            prefixes=max(1, args.clients // (8 if fewshot else 4)),
            prefix_tokens=max(1, args.system_tokens * (1 if fewshot else 3)),
            question_tokens=max(1, args.turn_tokens // 2),
            output_tokens=args.output_tokens,
            tenants=args.tenants,
            seed=args.seed,
            vocab=vocab,
        )
        return TraceReplay(shared_prefix_trace(shared), args.rate, args.seed)
    chat = ChatConfig(
        clients=args.clients, rounds=args.rounds, system_tokens=args.system_tokens,
        turn_tokens=args.turn_tokens, output_tokens=args.output_tokens, tenants=args.tenants,
        rate=args.rate, seed=args.seed, vocab=vocab,
    )  # fmt: skip
    return MultiTurnChat(chat)


@dataclasses.dataclass(slots=True)
class _ConfigRun:
    """One configuration's run: its row, what each request generated, and the prompts."""

    row: dict[str, Any]
    outputs: dict[str, list[int]]
    prompts: list[Any]
    first_error: str | None  # of the requests that failed, the first one's error


async def _run_one(
    args: argparse.Namespace,
    model: ServingModel,
    mode: CacheMode,
    hicache: HiCacheConfig,
    trace: list[TraceRequest] | None,
) -> _ConfigRun:
    hisparse = (
        hisparse_config(args) if mode in (CacheMode.DEVICE_HOST, CacheMode.DEVICE_HOST_L3) else None
    )
    engine_config = engine_config_of(args, hisparse)
    source = _source(args, model.config.vocab_size, trace)
    try:
        setup = await open_engine(model, mode, hicache, args.device_tokens, engine_config)
    except BackendError as exc:  # L3 required (storage.required) and unreachable
        raise CommandFailed(str(exc)) from exc
    if args.l3_bandwidth and setup.cache is not None:
        rate = args.l3_bandwidth * 1e6
        limits = LatencyConfig(read_bandwidth_bps=rate, write_bandwidth_bps=rate)
        setup.cache.wrap_l3_backend(lambda backend: LatencyBackend(backend, limits))
    run = _ConfigRun({}, {}, [], None)
    finished = source.finished

    def on_finished(request: Any, now: float) -> None:
        run.outputs[request.rid] = list(request.generated)
        if request.record.error is None:  # the oracle and working set count served requests
            run.prompts.append((request.namespace, request.prompt, request.generated))
        if not args.quiet and not args.json:
            print(f"\r{mode.value:<15} {len(run.outputs)} requests done", end="", file=sys.stderr)
        finished(request, now)

    source.finished = on_finished
    started = time.perf_counter()
    try:
        records = await setup.engine.run(source)
        l3 = await setup.l3_stats()
        if setup.cache is not None:  # what is queued for L3 lands before L3 is counted
            with contextlib.suppress(TimeoutError):  # a slow L3: count what is there
                await setup.cache.quiesce(_SETTLE_S)
        wall = time.perf_counter() - started  # the run and its L3 writes, not the count below
        sizes = await pool_bytes(setup.engine.pools, setup.cache)
    finally:
        await setup.close()
    if not args.quiet and not args.json:
        print(file=sys.stderr)
    run.row = config_row(setup, mode.value, records, wall, l3, sizes)
    if mode is CacheMode.DEVICE_HOST_L3 and hicache.storage.discard_on_close and setup.cache:
        run.row["l3_discarded_objects"] = int(setup.cache.metrics.counts["l3_discarded_objects"])
    run.first_error = next((r.error for r in records if r.error is not None), None)
    return run


async def _serve(args: argparse.Namespace) -> tuple[dict[str, Any], list[_ConfigRun]]:
    hicache = l3_namespace(hicache_config(args), args.l3_warm)
    model_config, plan, device = checked_model(args, hicache)
    trace = _load_trace(args, plan)
    model: ServingModel = plan.load() if plan else TinyTransformer(model_config, device)
    main = CacheMode.DEVICE_HOST if hicache.storage.url is None else CacheMode.DEVICE_HOST_L3
    modes = [main]
    if args.compare:
        modes = [CacheMode.NONE, CacheMode.DEVICE, CacheMode.DEVICE_HOST, *modes[:1]]
        modes = list(dict.fromkeys(modes))
    runs = [await _run_one(args, model, mode, hicache, trace) for mode in modes]
    prompts = next((run.prompts for run in runs if run.prompts), [])
    result = {
        "model": dataclasses.asdict(model_config) | {"preset": model_config.preset.value,
                                                     "kv_dtype": model_config.kv_dtype.label}
        | (plan.describe() if plan else {}),
        "l3": None if hicache.storage.url is None else redact_url(hicache.storage.url),
        "l3_warm": bool(args.l3_warm),
        "configs": [run.row for run in runs],
        "oracle_hit_rate": oracle_hit_rate(
            prompts, model_config.page_size, model_config.keep_interval
        ),
        "outputs_identical": _identical([run.outputs for run in runs]),
        "working_set_tokens": _unique_tokens(prompts, model_config.page_size),
        "device_tokens": args.device_tokens,
        "host_tokens": _host_tokens(args, hicache),
    }  # fmt: skip
    return result, runs


def _identical(outputs: list[dict[str, list[int]]]) -> bool | None:
    """Whether every configuration generated the same tokens; None when nothing was compared
    (one configuration, or no request succeeded anywhere)."""
    if len(outputs) < 2 or not any(any(o.values()) for o in outputs):
        return None
    return all(o == outputs[0] for o in outputs[1:])


def _unique_tokens(prompts: list[Any], page: int) -> int:
    """Tokens an unbounded cache would hold after the run (prompts and outputs, whole pages)."""
    from hicache.keys import RadixKey
    from hicache.radix.tree import RadixCache, RadixCacheConfig

    tree = RadixCache(RadixCacheConfig(page_size=page, simulated=True))
    for namespace, prompt, output in prompts:
        tree.insert(RadixKey(prompt + output, namespace))
    return sum(node.length for node in tree.all_nodes())


def _host_tokens(args: argparse.Namespace, hicache: HiCacheConfig) -> int:
    if not hicache.tiers.host_enabled:
        return 0
    return host_pages(hicache, args.device_tokens, args.page_size) * int(args.page_size)


async def _serve_settled(args: argparse.Namespace) -> tuple[dict[str, Any], list[_ConfigRun]]:
    """:func:`_serve`, then a wait for the tasks it leaves behind, whether it returned or
    raised: an L3 call abandoned by a cancelled prefetch still runs in its thread, and the
    event loop's shutdown would cancel it mid-call and print a traceback for each."""
    try:
        return await _serve(args)
    finally:
        me = asyncio.current_task()
        left = [task for task in asyncio.all_tasks() if task is not me]
        if left:
            await asyncio.wait(left, timeout=_SETTLE_S)


_SETTLE_S = 30.0


def run_serve(args: argparse.Namespace) -> int:
    # The forward runs in a worker thread; a short GIL switch interval lets the L3 tasks on the
    # event loop answer within about a millisecond instead of five.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        if args.http is not None or args.workers > 1:
            return run_online(args)
        result, runs = asyncio.run(_serve_settled(args))
    finally:
        sys.setswitchinterval(interval)
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        print_table(result["configs"], sys.stdout)
        identical = result["outputs_identical"]
        shown = "n/a (one configuration)" if identical is None and len(runs) < 2 else identical
        print(f"oracle hit rate {result['oracle_hit_rate']:.3f}; "
              f"outputs identical across configs: {shown}")  # fmt: skip
    if args.plot:
        from hicache.workloads.plot import plot_rounds

        plot_rounds(result["configs"], args.plot)
    if args.dump_outputs:
        write_outputs(args.dump_outputs, runs[-1].outputs)
    _check_outcome(result, runs)
    return 0


def _check_outcome(result: dict[str, Any], runs: list[_ConfigRun]) -> None:
    """Raise :class:`CommandFailed` (exit 1) when a configuration served nothing, or when the
    configurations generated different tokens."""
    empty = [run for run in runs if run.row["requests"] == 0]
    if empty:
        names = ", ".join(run.row["name"] for run in empty)
        first = empty[0]
        raise CommandFailed(
            f"no request succeeded ({names}): {first.row['failed']} failed, the first with: "
            f"{first.first_error}"
        )
    if result["outputs_identical"] is False:
        raise CommandFailed("the configurations generated different tokens (see the rows)")
