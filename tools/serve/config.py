"""What ``hicache serve``'s flags describe: the model, the tiered cache's config, and a check that
the sizes fit together and in this machine's memory before anything is allocated."""

from __future__ import annotations

import argparse
import json
import os
import secrets
from typing import Any

import torch

from hicache.dtypes import DType
from hicache.errors import ConfigError
from hicache.models.config import (
    DSV4_RATIOS,
    MODEL_LIMITS,
    ModelConfig,
    ModelPreset,
    check_dsv4_page_size,
    check_whole_pages,
    dsv4_defaults,
)
from hicache.models.hf.loader import COMPUTE_DTYPES, CheckpointPlan, open_checkpoint
from hicache.radix.eviction import EvictionPolicy
from hicache.scheduling.router import RouterConfig
from hicache.scheduling.scheduler import SchedulePolicy
from hicache.serving.engine import EngineConfig
from hicache.serving.setup import device_slots, host_pages, resolve_device
from hicache.sparse.hot_buffer import HOT_PAGES_MAX, HiSparseConfig
from hicache.tiering.common.config import HiCacheConfig, check_config
from hicache.tools import cli_parsing
from hicache.tools.cli_parsing import Flag, add_flags, int_range
from hicache.tools.config_flags import config_from_args

__all__ = [
    "MAX_REQUESTS",
    "add_hisparse_flags",
    "add_pool_flags",
    "l3_namespace",
    "write_outputs",
    "check_index_topk",
    "check_sizes",
    "add_policy_flags",
    "checked_model",
    "engine_config_of",
    "hicache_config",
    "hisparse_config",
    "model_config",
    "router_config_of",
]

MAX_REQUESTS = 1_000_000  # clients x rounds


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The model ``serve``'s flags describe; the pool flags checked against the page size."""
    device = resolve_device(args.device)
    given = {
        "window": args.window,
        "state_interval": args.state_interval,
        "window_interval": args.window_interval,
    }
    given = {name: value for name, value in given.items() if value is not None}
    preset = ModelPreset(args.preset)
    if preset is ModelPreset.DSV4:  # --page-size 16 (the default) is refused, named
        check_dsv4_page_size(args.page_size)
    for name, value in given.items():  # a flag given is meant: refused whatever the preset
        check_whole_pages(name, value, args.page_size)
    if preset is ModelPreset.DSV4:
        defaults = dsv4_defaults(args.page_size, ModelConfig().window_interval)
        given = defaults | given
    return ModelConfig(
        preset=preset, vocab_size=args.vocab, hidden=args.hidden,
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        page_size=args.page_size, seed=args.seed, index_topk_pages=args.index_topk or 0,
        kv_dtype=DType.BFLOAT16 if device.type == "cuda" else DType.FLOAT32, **given,
    )  # fmt: skip


def add_pool_flags(m: Any) -> None:
    """The sizes of the swa, dsv4 and hybrid presets' own pools (their defaults: ModelConfig's;
    dsv4's window: see :func:`~hicache.models.config.dsv4_defaults`)."""
    defaults = ModelConfig()
    m.add_argument(
        "--window",
        type=int_range(1, MODEL_LIMITS["window"]),
        help="swa and dsv4 presets: the sliding window in tokens, a multiple of --page-size "
        f"(default {defaults.window}; dsv4: one page, and at least 128)",
    )
    m.add_argument(
        "--window-interval",
        type=int_range(1, MODEL_LIMITS["window_interval"]),
        help="swa and dsv4 presets: tokens between the windows kept in the cache (besides those "
        f"at prompt ends), a multiple of --page-size (default {defaults.window_interval}; "
        "dsv4: rounded up to whole pages)",
    )
    m.add_argument(
        "--state-interval",
        type=int_range(1, MODEL_LIMITS["state_interval"]),
        help="hybrid preset: tokens between recurrent-state snapshots, a multiple of "
        f"--page-size (default {defaults.state_interval})",
    )


def add_hisparse_flags(group: Any) -> None:
    group.add_argument(
        "--hisparse",
        action="store_true",
        help="dsa and dsv4 presets: decode from a per-request device hot buffer over host memory "
        "(the configurations with a host tier)",
    )
    group.add_argument(
        "--hot-pages",
        type=int_range(1, HOT_PAGES_MAX),
        default=HiSparseConfig().hot_pages,
        help="--hisparse: device pages of latent (dsv4: C4) per request and layer (at least "
        "--index-topk; dsv4: --index-topk + 1)",
    )


def hisparse_config(args: argparse.Namespace) -> HiSparseConfig | None:
    """HiSparse as ``--hisparse`` and ``--hot-pages`` say (None without ``--hisparse``)."""
    return HiSparseConfig(hot_pages=args.hot_pages) if args.hisparse else None


def l3_namespace(config: HiCacheConfig, warm: bool) -> HiCacheConfig:
    """``config`` with an L3 namespace of the run's own (a model id no earlier run used: its
    keys match no stored page, and no later run can name them, so they are deleted when the
    run closes its cache), unless ``warm``: then the model's shared namespace, where earlier
    warm runs wrote and later ones read."""
    if warm or config.storage.url is None:
        return config
    model_id = f"{config.storage.model_id}-run-{secrets.token_hex(6)}"
    return config.with_changes("storage", model_id=model_id, discard_on_close=True)


def write_outputs(path: str, outputs: dict[str, list[int]]) -> None:
    """One JSON line ``{"id", "output_tokens"}`` per request, in id order."""
    with open(path, "w", encoding="utf-8") as out:
        for rid in sorted(outputs):
            out.write(json.dumps({"id": rid, "output_tokens": outputs[rid]}) + "\n")


def hicache_config(args: argparse.Namespace) -> HiCacheConfig:
    """The tiered cache ``serve``'s flags and config file describe (L3 on local disk by
    default)."""
    base = HiCacheConfig()
    base = base.with_changes("tiers", host_ratio=2.0)
    base = base.with_changes("storage", url=f"disk://{os.path.abspath(args.cache_dir)}")
    base = base.with_changes("prefetch", threshold_tokens=max(args.page_size, 64))
    config = config_from_args(args, base)
    check_config(config, args.page_size)
    return config


def check_index_topk(topk: int, model: ModelConfig, device_tokens: int) -> None:
    """Refuse an ``--index-topk`` above what ``device_tokens`` of the anchor pool hold: DSA
    pages, dsv4 C4 entries (one per 4 tokens). The default is never refused: a query picks
    among the complete entries (pages) there are, all of them when fewer."""
    if model.preset is ModelPreset.DSV4:
        ratio = DSV4_RATIOS[0]
        held, what = device_tokens // ratio, f"C4 entries (one per {ratio} tokens)"
    elif model.preset is ModelPreset.DSA:
        held, what = device_tokens // model.page_size, f"pages of {model.page_size} tokens"
    else:
        return
    if topk > held:
        raise ConfigError(
            f"--index-topk {topk} is more than the {held} {what} that --device-tokens "
            f"{device_tokens} hold"
        )


def check_sizes(
    args: argparse.Namespace,
    model: ModelConfig,
    hicache: HiCacheConfig,
    weight_bytes: int | None = None,
) -> None:
    """Refuse sizes that cannot work together, before anything is allocated (``weight_bytes``:
    a checkpoint's weights, else the seeded model's are estimated)."""
    if args.device_tokens % args.page_size:
        raise ConfigError(
            f"--device-tokens {args.device_tokens} must be a multiple of --page-size "
            f"{args.page_size}"
        )
    if args.clients * args.rounds > MAX_REQUESTS:
        raise ConfigError(f"--clients x --rounds must be at most {MAX_REQUESTS} requests")
    if args.model is None and args.index_topk is not None:
        check_index_topk(args.index_topk, model, args.device_tokens)
    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (try --device cpu)")
    need_device, need_host = _memory_needed(args, model, hicache, device, weight_bytes)
    ram = cli_parsing.host_memory()
    if device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device).total_memory
        budgets = [("GPU", need_device, gpu), ("host", need_host, ram)]
    else:
        budgets = [("host", need_device + need_host, ram)]
    for where, need, have in budgets:
        if need > have:
            raise ConfigError(
                f"the model, pools and workload need about {need / 2**30:.1f} GiB of {where} "
                f"memory, more than the {have / 2**30:.1f} GiB here; lower --layers, --hidden, "
                "--vocab, --device-tokens or the host tier's size"
            )


def _memory_needed(
    args: argparse.Namespace,
    model: ModelConfig,
    hicache: HiCacheConfig,
    device: torch.device,
    weight_bytes: int | None,
) -> tuple[int, int]:
    """Bytes the run may allocate, (on the device, on the host), estimated from above: weights,
    pools, the request table, and the scratch of a chunk over the longest prompt that fits."""
    c = model
    q, kv, h = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.hidden
    recurrent = c.state_inner + c.state_dim  # w_in, w_out; w_b, w_c
    per_layer = 6 * h * h + 2 * h * (q + kv + recurrent + c.index_dim + c.latent_dim)
    # dsv4: a layer's compression of a group's K/V (128 tokens', or 4's) into an entry, the
    # entry's up-projections to K and V, and (CSA) its index key projection
    groups = ((128, c.c128_dim), (4, c.c4_dim))
    compressed = max(2 * kv * d * (r + 1) for r, d in groups) + c.c4_dim * c.index_dim
    per_layer += compressed if c.preset is ModelPreset.DSV4 else 0
    weights = 2 * c.vocab_size * h + c.layers * (per_layer + 2 * c.latent_dim * q)
    element = 8 if device.type == "cpu" else 4  # the model computes in float64 on the CPU
    if weight_bytes is not None:  # a checkpoint: computes in its pools' dtype
        element = model.kv_dtype.itemsize
    token_bytes = sum(spec.layout.token_bytes for spec in c.pools())
    engine = EngineConfig(max_running=args.max_running, chunk_tokens=args.chunk_tokens)
    slots = device_slots(c, args.device_tokens, engine)
    pools = sum(slots[p.shares_slots_with or p.name] * p.layout.token_bytes for p in c.pools())
    context = args.device_tokens  # the longest prompt a request can have
    chunk = min(args.chunk_tokens, context)
    scratch = chunk * (context * c.heads + c.vocab_size + 8 * h) * element
    weights = weight_bytes if weight_bytes is not None else weights * element
    on_device = weights + pools + scratch
    host = 0
    if hicache.tiers.host_enabled:
        host = host_pages(hicache, args.device_tokens, args.page_size) * args.page_size
    on_host = host * token_bytes + args.max_running * context * 8  # + the request table
    return on_device, on_host


def checked_model(
    args: argparse.Namespace, hicache: HiCacheConfig
) -> tuple[ModelConfig, CheckpointPlan | None, Any]:
    """The model's config, its checkpoint (headers read only) and device, every size checked
    before anything is allocated."""
    device = resolve_device(args.device)
    plan = None
    if args.model is not None:  # headers only: nothing is read before the checks below
        dtype = COMPUTE_DTYPES[args.dtype] if args.dtype else None
        plan = open_checkpoint(args.model, device, args.page_size, dtype)
        config = plan.config
    else:
        config = model_config(args)
    hisparse = hisparse_config(args)
    if hisparse is not None:
        hisparse.check(config, args.device_tokens)
    check_sizes(args, config, hicache, plan.weight_bytes if plan else None)
    return config, plan, device


def add_policy_flags(e: Any) -> None:
    """The engine's eviction policy and prefill delayer."""
    eviction = Flag.choice(
        "--eviction", EvictionPolicy, EvictionPolicy.LRU,
        "which cached prefixes go first when the device (and host) fill up; priority: "
        "those of lower-priority requests",
    )  # fmt: skip
    delay_prefill = Flag.switch(
        "--delay-prefill",
        "hold prefill up to 50 ms while queued requests share prefixes and hits are rare",
    )
    add_flags(e, (eviction, delay_prefill))


def engine_config_of(args: argparse.Namespace, hisparse: HiSparseConfig | None) -> EngineConfig:
    """The engine settings ``serve``'s flags give."""
    return EngineConfig(
        max_running=args.max_running, chunk_tokens=args.chunk_tokens,
        schedule=SchedulePolicy(args.schedule), temperature=args.temperature, hisparse=hisparse,
        skip_slow_prefetch=not args.no_prefetch_skip, eviction=EvictionPolicy(args.eviction),
        delay_prefill=args.delay_prefill, host_hit_weight=args.host_hit_weight,
    )  # fmt: skip


def router_config_of(args: argparse.Namespace, hicache: HiCacheConfig) -> RouterConfig:
    """The cache-aware router's model of its workers, each started with these flags: a device
    of ``--device-tokens``, then the host tier's tokens (when on) behind it."""
    host = 0
    if hicache.tiers.host_enabled:
        host = host_pages(hicache, args.device_tokens, args.page_size) * args.page_size
    return RouterConfig(
        max_tree_tokens=args.device_tokens + host, page_size=args.page_size,
        device_tree_tokens=args.device_tokens, host_hit_weight=args.host_hit_weight,
    )  # fmt: skip
