"""``hicache serve``'s model and workload flags (the rest are its engine's, L3's and output's:
:func:`hicache.tools.serve.command.add_serve_parser`)."""

from __future__ import annotations

import argparse
import math
import os

from hicache.models.config import MODEL_LIMITS, SEED_MAX, ModelPreset, default_index_topk
from hicache.models.hf.loader import COMPUTE_DTYPES
from hicache.tools.cli_parsing import arg_type, input_file, int_range, output_file, path_arg
from hicache.tools.serve.config import add_pool_flags

__all__ = ["add_model_and_workload_flags", "plot_file"]

# Upper bounds of the workload: far past a benchmark, low enough that a typo is refused.
_MAX_CLIENTS = 100_000
_MAX_TOKENS = 1 << 20  # per span: system prompt, turn, answer
_MIN_RATE = 1e-3  # a lower rate than one arrival per 1000 s is a typo, and never ends


def _rate(text: str) -> float:
    value = float(text.strip())
    if value == 0 or (math.isfinite(value) and _MIN_RATE <= value <= 1e6):
        return abs(value)  # -0.0 is 0
    raise ValueError(f"must be 0 (all at once) or in [{_MIN_RATE:g}, 1e6] arrivals/s, got {text!r}")


def plot_file(text: str) -> str:
    """A .png, .svg or .pdf file to write (matplotlib picks the format from the suffix, and
    would add ``.png`` to a name without one, so a name without one is refused)."""
    path = str(output_file(text))
    if os.path.splitext(path)[1].lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"name a .png, .svg or .pdf file, got {text!r}")
    return path


def add_model_and_workload_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        type=path_arg,
        help="serve a Hugging Face checkpoint directory (config.json and *.safetensors; "
        "Llama, Qwen2, Qwen3, DeepSeek-V3, Jamba); its config replaces --preset and the size "
        "flags",
    )
    m.add_argument(
        "--dtype",
        choices=sorted(COMPUTE_DTYPES),
        help="--model: the dtype of compute and cached K/V (default: the checkpoint's on CUDA, "
        "float32 on a CPU)",
    )
    m.add_argument("--preset", choices=[x.value for x in ModelPreset], default="dense")
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    sizes = {"layers": 4, "hidden": 256, "heads": 8, "kv-heads": 2, "head-dim": 32}
    for flag, default in {**sizes, "vocab": 32000, "page-size": 16}.items():
        limit = MODEL_LIMITS["vocab_size" if flag == "vocab" else flag.replace("-", "_")]
        m.add_argument(f"--{flag}", type=int_range(1, limit), default=default)
    m.add_argument("--seed", type=int_range(0, SEED_MAX), default=0)
    m.add_argument(
        "--index-topk",
        type=int_range(1, MODEL_LIMITS["index_topk_pages"]),
        help="dsa preset: pages each query attends to (its own included; default "
        f"{default_index_topk(ModelPreset.DSA, 1)}); dsv4: C4 entries each query attends to "
        f"(default: the seed's top-512 per 128-token window scaled to --window, "
        f"{default_index_topk(ModelPreset.DSV4, 128)} at the default window of 128); at most "
        "what the device pool holds",
    )
    add_pool_flags(m)
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace",
        type=input_file,
        help="replay a JSONL trace ({id, namespace, tokens, output_tokens})",
    )
    w.add_argument(
        "--workload",
        choices=["chat", "fewshot", "longdoc"],
        default="chat",
        help="chat: multi-turn; fewshot: shared templates; longdoc: documents asked several "
        "questions (clients x rounds requests, Poisson arrivals at --rate)",
    )
    # Defaults: 40 chats of 4 turns over 2 system prompts, about 21.5k distinct tokens: over 4x
    # the device pool and 1.5x the host pool. Short answers keep the run prefill-bound, as the
    # reference HiCache benchmarks run (their output length 1 simulates a prefill node).
    w.add_argument("--clients", type=int_range(1, _MAX_CLIENTS), default=40)
    w.add_argument("--rounds", type=int_range(1, 10_000), default=4)
    w.add_argument("--system-tokens", type=int_range(0, _MAX_TOKENS), default=512)
    w.add_argument("--turn-tokens", type=int_range(1, _MAX_TOKENS), default=128)
    w.add_argument("--output-tokens", type=int_range(1, _MAX_TOKENS), default=2)
    w.add_argument("--tenants", type=int_range(1, _MAX_CLIENTS), default=1)
    w.add_argument(
        "--rate", type=arg_type(_rate), default=0.0, help="arrivals/s (Poisson); 0: at once"
    )
