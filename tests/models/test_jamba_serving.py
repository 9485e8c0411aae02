"""Jamba checkpoints (attention between Mamba layers, a mixture of experts) served through every
cache configuration, against transformers.

A tiny random ``JambaForCausalLM`` built and saved by transformers is the reference: greedy
tokens identical and float32 logits within 1e-4 (relative) with no cache, device, device + host
and device + host + L3, its Mamba states resumed from the snapshots the cache kept. Its layers
cover every combination: Mamba and attention mixers, each with a plain MLP in one layer and the
experts in another. A second checkpoint covers the optional fields (biases, tied embeddings,
no experts) and a state resumed from a snapshot slot. A config field this model does not
compute is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest
import torch
from serving_kit import CHAT, PAGE, VOCAB, hicache_config, relative_error, serve
from test_hf_checkpoint_serving import assert_matches_transformers

from hicache.errors import CheckpointError, ConfigError
from hicache.models.config import LayerKind, ModelConfig, ModelPreset
from hicache.models.hf.loader import open_checkpoint
from hicache.models.types import ChunkInput
from hicache.pools.device import device_pools
from hicache.serving.engine import CacheMode
from hicache.workloads.synthetic import MultiTurnChat

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
# Attention at layers 1 and 3, Mamba at 0 and 2; experts at 0 (Mamba) and 3 (attention).
_JAMBA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
    num_experts=4, num_experts_per_tok=2, expert_layer_period=3, expert_layer_offset=0,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, initializer_range=0.2,
    # JambaConfig's default pad token (0) and end token (2) are ordinary tokens here: with them
    # generate() would mask every 0 in a prompt (Mamba zeroes its input, attention skips it)
    # and, asked for min_new_tokens, never pick a 2; a served prompt does neither.
    pad_token_id=None, eos_token_id=None,
)  # fmt: skip
# Four pages: short enough that the chat's shared prefixes end past a snapshot.
STATE_INTERVAL = 4 * PAGE
MODES = [CacheMode.NONE, CacheMode.DEVICE, CacheMode.DEVICE_HOST, CacheMode.DEVICE_HOST_L3]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> tuple[pathlib.Path, Any]:
    """(the checkpoint's directory, transformers' model)."""
    directory = tmp_path_factory.mktemp("jamba")
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(**_JAMBA)).eval()
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def checkpoint(saved: tuple[pathlib.Path, Any]) -> tuple[Any, Any]:
    """(transformers' model, ours with snapshots every ``STATE_INTERVAL`` tokens)."""
    directory, reference = saved
    plan = open_checkpoint(directory, CPU, PAGE)
    config = dataclasses.replace(plan.config, state_interval=STATE_INTERVAL)
    return reference, plan.family.build(plan.parsed, config, plan.files, CPU)


def test_layers_cover_both_mixers_and_both_feed_forwards(checkpoint: tuple[Any, Any]) -> None:
    _, ours = checkpoint
    attention, recurrent = LayerKind.ATTENTION, LayerKind.RECURRENT
    assert ours.config.preset is ModelPreset.HYBRID
    assert ours.config.layer_kinds() == [recurrent, attention, recurrent, attention]
    moe = [ours.cfg.is_moe(i) for i in range(4)]
    assert moe == [True, False, False, True]
    assert ours.config.state_inner == 128 and ours.config.state_dim == 8


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
async def test_chat_matches_transformers_in_every_configuration(
    checkpoint: tuple[Any, Any], mode: CacheMode, tmp_path: pathlib.Path
) -> None:
    """Multi-turn chat with two requests at once: prefill chunks and decode rows in the same
    steps, and prefixes hit (their Mamba state from a snapshot) on every tier."""
    reference, ours = checkpoint
    l3 = tmp_path / "l3" if mode is CacheMode.DEVICE_HOST_L3 else None
    run = await serve(
        ModelPreset.HYBRID, mode, MultiTurnChat(CHAT), hicache_config(l3), logits=True, model=ours
    )
    assert_matches_transformers(run, reference, mode.value)
    if mode is not CacheMode.NONE:
        hits = run.hits("device") + run.hits("host") + run.hits("l3")
        assert hits > 0, "the chat reused no prefix"


@torch.no_grad()
def test_other_fields_and_resumed_state_match_transformers(tmp_path: pathlib.Path) -> None:
    """Tied embeddings, in/out projection biases, no conv bias, an explicit dt rank, a
    3-wide conv, no experts and attention once in 3 layers; a prompt run in two chunks
    (snapshot taken inside the first), then again from the snapshot in another slot."""
    changes = dict(
        num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=2, num_experts=1,
        mamba_d_conv=3, mamba_expand=1, mamba_dt_rank=6, mamba_conv_bias=False,
        mamba_proj_bias=True, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(1)
    reference = transformers.JambaForCausalLM(transformers.JambaConfig(**_JAMBA | changes))
    for name, param in reference.named_parameters():
        if name.endswith("bias"):  # transformers initializes them to zeros
            param.normal_(0.0, 0.2)
    reference.eval().save_pretrained(tmp_path)
    ours = open_checkpoint(tmp_path, CPU, PAGE).load()
    pools = device_pools(ours.config.pools(), {"kv": 32, "conv": 8})
    prompt = torch.randint(0, VOCAB, (13,))
    want = reference(prompt[None]).logits[0, -1]
    ours.forward(ChunkInput(prompt[:7], 0, torch.arange(7), state_slot=3, snapshots={4: 5}), pools)
    got = ours.forward(ChunkInput(prompt[7:], 7, torch.arange(13), state_slot=3), pools)
    assert relative_error(got, want) <= 1e-4
    resumed = ChunkInput(prompt[4:], 4, torch.arange(13), state_slot=6, state_from=5)
    assert relative_error(ours.forward(resumed, pools), want) <= 1e-4


def _copy(saved: pathlib.Path, tmp_path: pathlib.Path, **changes: Any) -> pathlib.Path:
    """A copy of the checkpoint with ``changes`` made to its config.json."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in saved.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | changes))
    return out


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": 64}, "sliding_window"),
        ({"attn_layer_offset": 2}, "attn_layer_offset"),
        ({"attn_layer_period": 1, "attn_layer_offset": 0}, "attn_layer_period"),
        ({"attn_layer_period": 8, "attn_layer_offset": 5}, "attn_layer_period"),
        ({"expert_layer_offset": -1}, "expert_layer_offset"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"mamba_dt_rank": "full"}, "mamba_dt_rank"),
        ({"mamba_conv_bias": "yes"}, "mamba_conv_bias"),
        ({"mamba_d_conv": 1}, "mamba_d_conv"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_config_is_refused_by_name(
    saved: tuple[pathlib.Path, Any], tmp_path: pathlib.Path, changes: dict[str, Any], named: str
) -> None:
    directory = _copy(saved[0], tmp_path, **changes)
    with pytest.raises(CheckpointError, match=named):
        open_checkpoint(directory, CPU, PAGE)


def test_missing_mamba_tensor_is_refused(
    saved: tuple[pathlib.Path, Any], tmp_path: pathlib.Path
) -> None:
    """A mamba_proj_bias the tensors do not have: the biases are named as missing."""
    directory = _copy(saved[0], tmp_path, mamba_proj_bias=True)
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.0\.mamba\.in_proj\.bias"):
        open_checkpoint(directory, CPU, PAGE)


def test_hybrid_layer_pattern() -> None:
    """The default pattern is attention on even layers; a pattern without one of the kinds
    is refused."""
    kinds = ModelConfig(preset=ModelPreset.HYBRID, layers=4).layer_kinds()
    assert kinds == [LayerKind.ATTENTION, LayerKind.RECURRENT] * 2
    shifted = ModelConfig(preset=ModelPreset.HYBRID, layers=6, attention_period=3,
                          attention_offset=2)  # fmt: skip
    assert [k is LayerKind.ATTENTION for k in shifted.layer_kinds()] == [False, False, True] * 2
    for period, offset in ((1, 0), (8, 4), (2, 2), (0, 0)):
        with pytest.raises(ConfigError, match="attention_"):
            ModelConfig(preset=ModelPreset.HYBRID, layers=4, attention_period=period,
                        attention_offset=offset)  # fmt: skip
