"""``hicache bench radix``: replay a request trace through a simulated radix tree.

Per request, exactly: (a) ``hit`` = the page-aligned match of the prompt in its namespace;
(b) with a capacity of N tokens, if ``cached + aligned(prompt + output) - hit > N``, lock the
matched prefix, evict the excess, unlock; (c) insert ``prompt + output``. Only this loop is timed,
best of N, each run from an empty tree; it includes turning each request's token lists into the
key format (a uint32 buffer), which a server pays once per request.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import time
from array import array
from collections.abc import Sequence
from typing import Any

from hicache.errors import InvalidArgumentError
from hicache.keys import RadixKey
from hicache.models.config import SEED_MAX
from hicache.radix import EvictionPolicy, RadixCache, RadixCacheConfig
from hicache.tools.bench.bench_flags import repeats_flag
from hicache.tools.cli_parsing import Flag, add_flags, float_range, int_range, output_file
from hicache.workloads.synthetic import (
    ChatConfig,
    TokenCount,
    WorkloadConfig,
    WorkloadKind,
    generate_trace,
)
from hicache.workloads.traces import TraceRequest, dump_trace, load_trace

__all__ = [
    "RadixBenchConfig",
    "add_bench_radix_parser",
    "bench_match_scaling",
    "bench_trace",
    "prepare_steps",
    "replay",
    "run_bench_radix",
]

logger = logging.getLogger(__name__)

# One request of the replay: prompt ids, output ids, namespace, page-aligned length of both.
_Step = tuple[list[int], list[int], str, int]
# Bounds of the flags. Each generated token costs about 12 bytes (a list slot, then a uint32
# in the packed key), so a trace is capped at 2^28 tokens: about 3 GiB.
_MAX_CLIENTS = 100_000
_MAX_ROUNDS = 1000
_MAX_FACTOR = 1000
_MAX_TRACE_TOKENS = 1 << 28


@dataclasses.dataclass(frozen=True, slots=True)
class RadixBenchConfig:
    page_size: int = 1
    policy: EvictionPolicy = EvictionPolicy.LRU
    capacity_tokens: int = 0  # 0: unbounded
    repeats: int = 3  # best of N

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise InvalidArgumentError(f"page_size must be a positive int, got {self.page_size}")
        if not isinstance(self.capacity_tokens, int) or self.capacity_tokens < 0:
            raise InvalidArgumentError(f"capacity_tokens must be >= 0, got {self.capacity_tokens}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise InvalidArgumentError(f"repeats must be >= 1, got {self.repeats}")


def prepare_steps(requests: Sequence[TraceRequest], page_size: int) -> list[_Step]:
    """What the replay loop reads per request, so the loop does no bookkeeping of its own."""
    steps: list[_Step] = []
    for req in requests:
        n = len(req.tokens) + len(req.output_tokens)
        steps.append((req.tokens, req.output_tokens, req.namespace, n - n % page_size))
    return steps


def replay(tree: RadixCache, steps: Sequence[_Step], capacity: int) -> tuple[int, int]:
    """The three steps for every request; returns (hit tokens, evicted tokens).

    Each request's token ids go once into a uint32 buffer that the output then extends, as a
    server keeps a request's ids while it decodes; the tree copies keys out of that buffer with a
    memcpy instead of converting a list of ints twice.
    """
    hits = evicted = 0
    match, insert = tree.match_prefix, tree.insert
    for tokens, output, namespace, aligned in steps:
        ids = array("I")
        ids.fromlist(tokens)  # faster than array("I", tokens), which converts item by item
        result = match(RadixKey(ids, namespace))
        hit = result.prefix_len
        hits += hit
        if capacity:
            excess = tree.total_size + aligned - hit - capacity
            if excess > 0:
                node = result.last_device_node
                tree.inc_lock_ref(node)  # the prefix this request is about to use stays
                evicted += tree.evict(excess)
                tree.dec_lock_ref(node)
        ids.fromlist(output)
        insert(RadixKey(ids, namespace))
    return hits, evicted


def bench_trace(requests: Sequence[TraceRequest], config: RadixBenchConfig) -> dict[str, Any]:
    """Replay ``requests`` ``config.repeats`` times; the figures of the fastest run."""
    if not requests:
        raise InvalidArgumentError("the trace holds no requests")
    steps = prepare_steps(requests, config.page_size)
    tree_config = RadixCacheConfig(config.page_size, config.policy, simulated=True)
    best = float("inf")
    for _ in range(config.repeats):
        tree = RadixCache(tree_config)
        gc.collect()  # start each run with the same heap, not the last run's garbage
        start = time.perf_counter()
        hits, evicted = replay(tree, steps, config.capacity_tokens)
        best = min(best, time.perf_counter() - start)
    prompt_tokens = sum(len(r.tokens) for r in requests)
    return {
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hits,
        "hit_rate": round(hits / prompt_tokens, 6),
        "evicted_tokens": evicted,
        "final_cached_tokens": tree.total_size,
        "seconds": round(best, 6),
        "us_per_request": round(best / len(requests) * 1e6, 3),
        "page_size": config.page_size,
        "policy": config.policy.value,
        "capacity_tokens": config.capacity_tokens,
        "nodes": tree.total_nodes,
    }


def bench_match_scaling(
    workload: WorkloadConfig, factor: int, page_size: int, repeats: int = 3
) -> dict[str, Any]:
    """Match cost against a tree of one trace vs. ``factor`` times as many cached sequences.

    The probes are the prompts of the ``workload`` trace, matched (match only, keys already
    packed) once the tree holds that trace, and again once it also holds ``factor - 1`` traces
    of other seeds: unrelated sequences of the same shape. Both trees cache every probe whole,
    so each probe matches the same pages in both.
    """
    if not isinstance(factor, int) or factor < 2:
        raise InvalidArgumentError(f"the scaling factor must be an int >= 2, got {factor!r}")
    base = generate_trace(workload)
    probes = [RadixKey(array("I", r.tokens), r.namespace) for r in base]
    row: dict[str, Any] = {"workload": workload.kind.value, "page_size": page_size}
    requests = list(base)
    for label in ("1x", f"{factor}x"):
        if label != "1x":
            for i in range(1, factor):
                requests += generate_trace(dataclasses.replace(workload, seed=workload.seed + i))
        tree = RadixCache(RadixCacheConfig(page_size, simulated=True))
        replay(tree, prepare_steps(requests, page_size), 0)
        matched = sum(tree.match_prefix(k).prefix_len for k in probes)  # splits happen here
        best = float("inf")
        for _ in range(repeats):
            gc.collect()
            start = time.perf_counter()
            for key in probes:
                tree.match_prefix(key)
            best = min(best, time.perf_counter() - start)
        row[f"sequences_{label}"] = len(requests)
        row[f"nodes_{label}"] = tree.total_nodes
        row[f"us_per_match_{label}"] = round(best / len(probes) * 1e6, 3)
        row[f"ns_per_matched_page_{label}"] = round(best / max(1, matched // page_size) * 1e9, 3)
    row["matched_pages_per_probe"] = round(matched / page_size / len(probes), 1)
    return row


# ----- command line ---------------------------------------------------------------------------
# Where the requests come from: a trace file, or a generated workload (one or the other).
_SOURCE_FLAGS = (
    Flag.file("--trace", "JSONL trace, one request a line"),
    Flag.choice(
        "--workload", WorkloadKind, WorkloadKind.MULTITURN,
        "generate a trace instead (default: multiturn)",
    ),
)  # fmt: skip
_FLAGS = (
    Flag("--clients", int_range(1, _MAX_CLIENTS), 64, "generated: sources of requests"),
    Flag("--rounds", int_range(1, _MAX_ROUNDS), 5, "generated: requests per client"),
    Flag("--seed", int_range(0, SEED_MAX), 0, "generated: random seed"),
    Flag("--dump-trace", output_file, help="write the replayed trace as JSONL", metavar="FILE"),
    Flag("--page-size", int_range(1, 1 << 16), 1),
    Flag.choice("--policy", EvictionPolicy, EvictionPolicy.LRU, "eviction policy (default: lru)"),
    Flag("--capacity-tokens", int_range(0, 1 << 48), 0, "cache capacity in tokens (0: unbounded)"),
    Flag(
        "--capacity-share", float_range(0.0, 1.0, low_open=True),
        help="capacity as a share of the tokens an unbounded replay ends with (overrides "
        "--capacity-tokens; 0.25: a quarter of the unique tokens)",
    ),
    repeats_flag(3),
    Flag(
        "--match-scaling", int_range(2, _MAX_FACTOR), metavar="FACTOR",
        help="instead of a replay, time matching the generated trace's prompts against its own "
        "tree and against one holding FACTOR times as many sequences",
    ),
    Flag.switch("--json"),
)  # fmt: skip


def add_bench_radix_parser(
    bench_subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``radix`` to the ``hicache bench`` subcommands; ``run_bench_radix`` runs it."""
    p = bench_subparsers.add_parser(
        "radix", help="replay a request trace through the radix tree (simulated, no KV)"
    )
    add_flags(p.add_mutually_exclusive_group(), _SOURCE_FLAGS)
    add_flags(p, _FLAGS)
    p.set_defaults(bench_run=run_bench_radix)
    return p


def _requests(args: argparse.Namespace) -> tuple[list[TraceRequest], dict[str, Any]]:
    if args.trace:
        try:
            return load_trace(args.trace), {"trace": args.trace}
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read trace {args.trace}: {exc}") from None
    config = _workload(args, copies=1)
    about = {"workload": config.kind.value, "clients": config.clients, "rounds": config.rounds}
    return generate_trace(config), about


def _workload(args: argparse.Namespace, copies: int) -> WorkloadConfig:
    """The generated trace's preset; refused when ``copies`` of its trace would hold more
    tokens than the bench's bound (the flags are bounded one by one, not together)."""
    workload = WorkloadConfig(WorkloadKind(args.workload), args.clients, args.rounds, args.seed)
    tokens = _trace_tokens(workload) * copies
    if tokens > _MAX_TRACE_TOKENS:
        raise InvalidArgumentError(
            f"--clients {args.clients} and --rounds {args.rounds} make {copies} trace(s) of up "
            f"to {tokens} tokens, more than {_MAX_TRACE_TOKENS}; lower them"
        )
    return workload


def _trace_tokens(workload: WorkloadConfig) -> int:
    """At most how many tokens the prompts and answers of ``workload``'s trace hold. A
    multi-turn prompt holds the whole chat so far: a chat grows with the square of its rounds."""

    def most(count: TokenCount) -> int:
        return count if isinstance(count, int) else count[1]

    config = workload.generator_config()
    if isinstance(config, ChatConfig):
        turn, rounds = most(config.turn_tokens) + most(config.output_tokens), config.rounds
        return config.clients * (
            rounds * most(config.system_tokens) + turn * rounds * (rounds + 1) // 2
        )
    question = most(config.question_tokens) + most(config.output_tokens)
    return config.requests * (most(config.prefix_tokens) + question)


def _capacity_at_share(
    config: RadixBenchConfig, requests: Sequence[TraceRequest], share: float
) -> int:
    """``share`` of the tokens an unbounded replay ends with (its unique page-aligned tokens)."""
    if not 0.0 < share <= 1.0:
        raise InvalidArgumentError(f"--capacity-share must be in (0, 1], got {share}")
    tree = RadixCache(RadixCacheConfig(config.page_size, simulated=True))
    replay(tree, prepare_steps(requests, config.page_size), 0)
    return max(1, int(tree.total_size * share))


def run_bench_radix(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``hicache bench radix``: one result row (the required keys first)."""
    if args.match_scaling is not None:
        if args.trace:
            raise InvalidArgumentError("--match-scaling generates its traces; drop --trace")
        workload = _workload(args, copies=args.match_scaling)
        return [bench_match_scaling(workload, args.match_scaling, args.page_size, args.repeats)]
    requests, about = _requests(args)
    if args.dump_trace:
        try:
            dump_trace(requests, args.dump_trace)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot write trace {args.dump_trace}: {exc}") from None
    config = RadixBenchConfig(
        page_size=args.page_size,
        policy=EvictionPolicy(args.policy),
        capacity_tokens=args.capacity_tokens,
        repeats=args.repeats,
    )
    if args.capacity_share is not None:
        capacity = _capacity_at_share(config, requests, args.capacity_share)
        config = dataclasses.replace(config, capacity_tokens=capacity)
    logger.info("replaying %d requests with %s", len(requests), config)
    row = bench_trace(requests, config)
    row.update(about)
    return [row]
