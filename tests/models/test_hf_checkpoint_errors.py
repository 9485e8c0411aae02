"""``--model`` when the checkpoint is wrong, and text prompts: one clear error naming what is
wrong, before anything is allocated; a text prompt without a tokenizer fails alone."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
from cli_kit import run
from serving_kit import PAGE
from test_hf_checkpoint_serving import build_checkpoint

from hicache.errors import CheckpointError, TraceFormatError
from hicache.models.hf.loader import open_checkpoint
from hicache.workloads.traces import TraceRequest, dump_trace, load_trace

pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> pathlib.Path:
    """A good Qwen3 checkpoint, never changed: tests copy what they break."""
    directory = tmp_path_factory.mktemp("qwen3")
    build_checkpoint("qwen3", directory)
    return directory


def copy_of(saved: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in saved.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def edit_config(directory: pathlib.Path, **changes: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def rewrite_tensors(directory: pathlib.Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def refused(directory: pathlib.Path) -> str:
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(directory, CPU, PAGE)
    return str(err.value)


def test_unsupported_architecture_is_named(saved: pathlib.Path, tmp_path: pathlib.Path) -> None:
    ckpt = copy_of(saved, tmp_path)
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    message = refused(ckpt)
    assert "GPT2LMHeadModel" in message and "Qwen3ForCausalLM" in message


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
        ({"num_key_value_heads": 3}, "multiple of 3"),
        ({"head_dim": 15}, "even"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"dtype": "int8"}, "int8"),
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding-window"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ],
)
def test_unsupported_or_bad_config_is_named(
    saved: pathlib.Path, tmp_path: pathlib.Path, changes: dict[str, Any], named: str
) -> None:
    ckpt = copy_of(saved, tmp_path)
    edit_config(ckpt, **changes)
    assert named in refused(ckpt)


def test_missing_wrong_and_unexpected_tensors_are_listed(
    saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    ckpt = copy_of(saved, tmp_path)

    def damage(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.norm.weight"] = torch.ones(3)
        tensors["model.layers.0.extra.weight"] = torch.ones(2)

    rewrite_tensors(ckpt, damage)
    message = refused(ckpt)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "wrong shape: model.norm.weight [3] (expected [64])" in message
    assert "unexpected: model.layers.0.extra.weight" in message


def test_config_that_disagrees_with_the_tensors_is_refused(
    saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    ckpt = copy_of(saved, tmp_path)
    edit_config(ckpt, intermediate_size=100)
    assert "mlp.up_proj.weight [96, 64] (expected [100, 64])" in refused(ckpt)


def test_broken_files_and_directories(saved: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert "not a directory" in refused(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in refused(empty)
    ckpt = copy_of(saved, tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"not safetensors")
    assert "model.safetensors is not a safetensors file" in refused(ckpt)
    (ckpt / "config.json").write_text("{")
    assert "not readable JSON" in refused(ckpt)


def test_shard_index_cannot_leave_the_directory(
    saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    ckpt = copy_of(saved, tmp_path)
    index = {"weight_map": {"model.norm.weight": "../model.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "outside the checkpoint directory" in refused(ckpt)
    index = {"weight_map": {"model.norm.weight": "gone.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "'gone.safetensors', which does not exist" in refused(ckpt)


def test_cli_refuses_a_bad_checkpoint_before_serving(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
    code, out, err = run(capsys, "serve", "--model", str(tmp_path), "--cache-dir", str(tmp_path))
    assert code == 2 and out == ""
    assert "MixtralForCausalLM" in err.strip().splitlines()[-1]


# ----- text prompts -----------------------------------------------------------------------------
def test_trace_text_prompts_parse_and_round_trip(tmp_path: pathlib.Path) -> None:
    requests = [TraceRequest("a", "", [], [0, 0], "hello world"), TraceRequest("b", "", [5], [0])]
    dump_trace(requests, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == requests
    bad = tmp_path / "bad.jsonl"
    for row, problem in [
        ({"id": "x", "namespace": "", "output_tokens": []}, "one of them"),
        ({"id": "x", "namespace": "", "tokens": [1], "text": "a", "output_tokens": []}, "one of"),
        ({"id": "x", "namespace": "", "text": "", "output_tokens": []}, "'text' is empty"),
        ({"id": "x", "namespace": "", "text": 3, "output_tokens": []}, "'text' must be a string"),
    ]:
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(TraceFormatError, match=problem):
            load_trace(bad)


def word_tokenizer(directory: pathlib.Path, words: list[str]) -> None:
    """A word-level tokenizer.json: each word its index, anything else id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0} | {w: i + 1 for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def serve_trace(capsys: Any, ckpt: pathlib.Path, tmp_path: pathlib.Path) -> tuple[int, dict, dict]:
    requests = [
        TraceRequest("text", "", [], [0, 0], "the cat sat on the mat"),
        TraceRequest("ids", "", [1, 2, 3, 4, 1, 5], [0, 0]),
    ]
    dump_trace(requests, tmp_path / "trace.jsonl")
    dump = tmp_path / "out.jsonl"
    code, out, _ = run(
        capsys, "serve", "--model", str(ckpt), "--trace", str(tmp_path / "trace.jsonl"),
        "--cache-dir", str(tmp_path / "l3"), "--page-size", "4", "--device-tokens", "256",
        "--json", "--dump-outputs", str(dump), "-q",
    )  # fmt: skip
    outputs = {
        row["id"]: row["output_tokens"] for row in map(json.loads, dump.read_text().splitlines())
    }
    return code, json.loads(out), outputs


def test_text_prompts_go_through_the_tokenizer(
    capsys: pytest.CaptureFixture[str], saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """With tokenizer.json the text prompt is its word ids: it generates what the same ids do."""
    ckpt = copy_of(saved, tmp_path)
    word_tokenizer(ckpt, ["the", "cat", "sat", "on", "mat"])
    code, result, outputs = serve_trace(capsys, ckpt, tmp_path)
    assert code == 0, result
    assert result["model"]["architecture"] == "Qwen3ForCausalLM"
    assert result["configs"][0]["failed"] == 0
    assert outputs["text"] == outputs["ids"] and len(outputs["text"]) == 2


def test_text_prompt_without_a_tokenizer_fails_alone(
    capsys: pytest.CaptureFixture[str], saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    code, result, outputs = serve_trace(capsys, saved, tmp_path)
    assert code == 0
    row = result["configs"][0]
    assert row["failed"] == 1 and row["requests"] == 1
    assert outputs["text"] == [] and len(outputs["ids"]) == 2


def test_missing_packages_are_named(
    saved: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without hicache[hf]'s packages, --model says which to install (not a traceback)."""
    import sys

    from hicache.models.hf.tokenizer import load_tokenizer

    ckpt = copy_of(saved, tmp_path)
    word_tokenizer(ckpt, ["a"])
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert "pip install 'hicache[hf]'" in refused(ckpt)
    with pytest.raises(CheckpointError, match="tokenizers package"):
        load_tokenizer(ckpt)
