"""Hugging Face checkpoints served through every cache configuration, against transformers.

Tiny random checkpoints are built by transformers itself (config -> model -> save_pretrained);
transformers' greedy generation and logits are the reference the engine must reproduce: tokens
identical and float32 logits within 1e-4 (relative), with no cache, device, device + host,
device + host + L3, and a restart over the file L3.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from model_kit import reference_tokens
from serving_kit import (
    CHAT,
    PAGE,
    VOCAB,
    RunResult,
    Sequential,
    hicache_config,
    relative_error,
    revisit_prompts,
    serve,
)

from hicache.models.config import ModelPreset
from hicache.models.hf.loader import load_checkpoint
from hicache.serving.engine import CacheMode
from hicache.workloads.synthetic import MultiTurnChat

transformers = pytest.importorskip("transformers")

_SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
)  # fmt: skip
_LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}  # fmt: skip
# MLA with a low-rank query, interleaved rotary pairs, a dense first layer and routed experts
# in group-limited top-k (the MoE's sizes replace the dense ones).
_DEEPSEEK = dict(
    intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, head_dim=None,
)  # fmt: skip
# Each family's own features: Llama with tied embeddings, Llama 3.1's rope scaling and
# shards; Qwen2's q/k/v biases; Qwen3's per-head q/k norms; DeepSeek-V3's latent cache.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"tie_word_embeddings": True, "rope_parameters": _LLAMA3_ROPE}),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {}),
    "deepseek_v3": ("DeepseekV3", _DEEPSEEK),
}
PRESETS = {"deepseek_v3": ModelPreset.MLA}  # the rest: dense


def build_checkpoint(name: str, directory: pathlib.Path, seed: int = 0) -> Any:
    """A random checkpoint of ``name`` saved in ``directory``; the transformers model."""
    prefix, extra = ARCHITECTURES[name]
    sizes = {k: v for k, v in {**_SIZES, **extra}.items() if v is not None}
    # No pad or end token: the engine knows neither, and generate() would mask a prompt's pad
    # ids or keep an end token from being chosen.
    special = dict.fromkeys(("pad_token_id", "eos_token_id", "bos_token_id"))
    config = getattr(transformers, f"{prefix}Config")(**sizes, **special)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    shard = "60KB" if name == "llama" else "1GB"  # llama: an index and several shards
    model.save_pretrained(directory, max_shard_size=shard)
    return model


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request: Any, tmp_path_factory: Any) -> tuple[Any, Any, ModelPreset]:
    """(transformers' model, ours, our pools' preset) for one architecture."""
    directory = tmp_path_factory.mktemp(request.param)
    reference = build_checkpoint(request.param, directory)
    ours = load_checkpoint(directory, torch.device("cpu"), PAGE)
    preset = PRESETS.get(request.param, ModelPreset.DENSE)
    assert ours.config.preset is preset
    return reference, ours, preset


@torch.no_grad()
def assert_matches_transformers(run: RunResult, model: Any, label: str) -> None:
    """Every request's tokens are transformers' greedy tokens, and every sampled position's
    logits are transformers' within 1e-4."""
    assert not run.errors, f"{label}: {run.errors}"
    assert run.outputs, f"{label}: nothing was served"
    worst = 0.0
    for rid, output in run.outputs.items():
        prompt = run.prompts[rid]
        assert output == reference_tokens(model, prompt, len(output)), f"{label}: {rid}"
        logits = model(torch.tensor([prompt + output])).logits[0]
        for i in range(len(output)):
            want = logits[len(prompt) - 1 + i]
            worst = max(worst, relative_error(run.logits[(rid, i)], want))
    assert worst <= 1e-4, f"{label}: logits differ from transformers' by {worst:.2e}"


MODES = [CacheMode.NONE, CacheMode.DEVICE, CacheMode.DEVICE_HOST, CacheMode.DEVICE_HOST_L3]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
async def test_chat_matches_transformers_in_every_configuration(
    checkpoint: tuple[Any, Any, ModelPreset], mode: CacheMode, tmp_path: pathlib.Path
) -> None:
    """Multi-turn chat with two requests running at once: prefill chunks and batched decode
    rows of different lengths in the same steps, prefixes hit on every tier."""
    reference, ours, preset = checkpoint
    l3 = tmp_path / "l3" if mode is CacheMode.DEVICE_HOST_L3 else None
    run = await serve(
        preset, mode, MultiTurnChat(CHAT), hicache_config(l3), logits=True, model=ours
    )
    assert_matches_transformers(run, reference, mode.value)
    if mode is not CacheMode.NONE:
        assert run.hits("device") + run.hits("host") > 0, "the chat reused no prefix"


async def test_restart_over_file_l3_reads_pages_back(
    checkpoint: tuple[Any, Any, ModelPreset], tmp_path: pathlib.Path
) -> None:
    """A second engine over the first one's file L3 hits what the first wrote, and still
    generates transformers' tokens."""
    reference, ours, preset = checkpoint
    config = hicache_config(tmp_path / "l3")
    prompts = revisit_prompts()
    first = await serve(preset, CacheMode.DEVICE_HOST_L3, Sequential(prompts), config, model=ours)
    assert not first.errors
    again = await serve(
        preset, CacheMode.DEVICE_HOST_L3, Sequential(prompts[:4]), config, logits=True,
        model=ours,
    )  # fmt: skip
    assert again.hits("l3") > 0, "the restart read nothing from L3"
    assert_matches_transformers(again, reference, "restart")
    assert all(again.outputs[rid] == first.outputs[rid] for rid in again.outputs)
