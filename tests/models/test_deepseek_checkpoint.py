"""DeepSeek-V3 (MLA + MoE) checkpoints through the paged latent pool, against transformers.

Tiny random checkpoints are built by transformers itself (config -> model -> save_pretrained),
with the biases it would initialise to zero (attention biases, the router's score correction)
made random so that every term counts. Its float32 logits and greedy tokens are the reference:
logits within 1e-4 (relative), tokens identical, prefill split into chunks and decode rows of
requests of different lengths batched in one step, over scrambled pool slots.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import torch
from model_kit import reference_tokens, relative_error

from hicache.errors import CheckpointError
from hicache.models.hf.loader import load_checkpoint, open_checkpoint
from hicache.models.types import ChunkInput
from hicache.pools.device import device_pools

transformers = pytest.importorskip("transformers")

VOCAB, PAGE, SLOTS = 512, 16, 256
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, initializer_range=0.2, max_position_embeddings=512,
)  # fmt: skip
_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 128, "beta_fast": 32,
    "beta_slow": 1,
}  # fmt: skip
# DeepSeek-V3's own setting (low-rank q, interleaved rotary pairs); a direct q projection with
# half-split pairs, biases and tied embeddings; yarn (its cos/sin factor and softmax mscale).
VARIANTS: dict[str, dict[str, Any]] = {
    "q_lora": {},
    "direct_q": {
        "q_lora_rank": None, "rope_interleave": False, "attention_bias": True,
        "tie_word_embeddings": True,
    },
    "yarn": {"rope_parameters": _YARN},
}  # fmt: skip


def build_checkpoint(extra: dict[str, Any], directory: pathlib.Path) -> Any:
    torch.manual_seed(0)
    # No pad or end token: the engine knows neither, and generate() would mask a prompt's pad
    # ids or stop at an end token.
    special = dict.fromkeys(("pad_token_id", "eos_token_id", "bos_token_id"))
    config = transformers.DeepseekV3Config(**{**_SIZES, **special, **extra})
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith((".bias", "e_score_correction_bias")):
                tensor.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: Any, tmp_path_factory: Any) -> tuple[Any, Any]:
    """(transformers' model, ours) for one variant."""
    directory = tmp_path_factory.mktemp(request.param)
    reference = build_checkpoint(VARIANTS[request.param], directory)
    return reference, load_checkpoint(directory, torch.device("cpu"), PAGE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> pathlib.Path:
    """One checkpoint's directory, for the tests that edit a copy of it."""
    directory = tmp_path_factory.mktemp("saved")
    build_checkpoint({}, directory)
    return directory


@torch.no_grad()
def reference_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1]


def test_chunked_prefill_matches_transformers_logits(checkpoint: Any) -> None:
    reference, ours = checkpoint
    pools = device_pools(ours.config.pools(), {"latent": SLOTS}, "cpu")
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1))
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(2))[:37]
    ours.forward_batch([ChunkInput(prompt[:20], 0, slots[:20])], pools)
    got = ours.forward_batch([ChunkInput(prompt[20:], 20, slots)], pools)[0]
    assert relative_error(got, reference_logits(reference, prompt.tolist())) < 1e-4


def test_batched_greedy_decode_matches_transformers(checkpoint: Any) -> None:
    """Two prompts of different lengths prefilled in one step, then decoded together."""
    reference, ours = checkpoint
    count, generator = 8, torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (29, 13)]
    scrambled = torch.randperm(SLOTS, generator=generator)
    slots = [scrambled[:64], scrambled[64:128]]
    pools = device_pools(ours.config.pools(), {"latent": SLOTS}, "cpu")
    chunks = [ChunkInput(torch.tensor(p), 0, s[: len(p)]) for p, s in zip(prompts, slots)]
    logits = ours.forward_batch(chunks, pools)
    tokens: list[list[int]] = [[int(row.argmax())] for row in logits]
    for _ in range(count - 1):
        chunks = [
            ChunkInput(torch.tensor(t[-1:]), len(p) + len(t) - 1, s[: len(p) + len(t)])
            for p, t, s in zip(prompts, tokens, slots)
        ]
        logits = ours.forward_batch(chunks, pools)
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    for prompt, got, last in zip(prompts, tokens, logits):
        assert got == reference_tokens(reference, prompt, count)
        want = reference_logits(reference, prompt + got[:-1])
        assert relative_error(last, want) < 1e-4


def _edited(source: pathlib.Path, target: pathlib.Path, **fields: Any) -> pathlib.Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hidden_act", "gelu", "hidden_act 'gelu'"),
        ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
        ("n_group", 3, "n_group 3"),
        ("scoring_func", "softmax", "scoring_func 'softmax'"),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
        ("num_key_value_heads", 2, "num_key_value_heads 2"),
    ],
)
def test_unsupported_config_is_refused_by_name(
    saved: pathlib.Path, tmp_path: pathlib.Path, field: str, value: Any, named: str
) -> None:
    directory = _edited(saved, tmp_path / "edited", **{field: value})
    with pytest.raises(CheckpointError, match=named):
        open_checkpoint(directory, torch.device("cpu"), PAGE)


def test_misshapen_tensor_is_refused_by_name(saved: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "misshapen"
    shutil.copytree(saved, directory)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name][:-1].clone()
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(directory, torch.device("cpu"), PAGE)
    assert name in str(raised.value)
    assert "missing: model.layers.2.mlp.experts.3.up_proj.weight" in str(raised.value)


def test_multi_token_prediction_layers_are_left_aside(
    saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Real DeepSeek-V3 checkpoints hold MTP modules as ``model.layers.<num_hidden_layers>.*``:
    accepted and not read; a stray tensor elsewhere is still refused."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "mtp"
    shutil.copytree(saved, directory)
    tensors = load_file(directory / "model.safetensors")
    layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.ones(4, 8)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    plan = open_checkpoint(directory, torch.device("cpu"), PAGE)
    assert plan.config.layers == layers
    tensors["model.extra.weight"] = torch.ones(2)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected: model\.extra\.weight"):
        open_checkpoint(directory, torch.device("cpu"), PAGE)
