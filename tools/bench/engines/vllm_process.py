"""`vllm serve` processes with hicache under them, for ``bench vllm-serve`` and its tests.

- :func:`write_checkpoint`: a tiny random Llama checkpoint (config, safetensors, and a
  ``tokenizer.json`` built with ``tokenizers``), so no hub is needed;
- :class:`VllmServer`: one vLLM OpenAI server on 127.0.0.1 as a subprocess, started and stopped
  by pid, its log in a file; the ``/dev/shm`` region of a killed server is removed;
- :func:`complete`: one greedy completion through the official ``openai`` client, with the
  prompt tokens vLLM reports cached.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 32  # vLLM's CPU attention wants a multiple of 32
START_TIMEOUT_S = 300.0
VOCAB = 512


def write_checkpoint(directory: Path, hidden: int = 128, layers: int = 2, seed: int = 0) -> Path:
    """A random Llama (bf16) with a word-level tokenizer over ``w3 .. w511``."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    heads, kv_heads, inter = max(hidden // 32, 2), max(hidden // 64, 1), hidden * 2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (directory / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    head_dim = hidden // heads
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    tensors = {
        "model.embed_tokens.weight": weight(VOCAB, hidden),
        "model.norm.weight": ones.clone(),
        "lm_head.weight": weight(VOCAB, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = weight(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = weight(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = weight(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = weight(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = weight(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = weight(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = weight(hidden, inter)
        tensors[p + "input_layernorm.weight"] = ones.clone()
        tensors[p + "post_attention_layernorm.weight"] = ones.clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 16384,
            }
        )
    )
    return directory


def kv_bytes_per_token(model: Path) -> int:
    """The KV bytes vLLM keeps per token of a Llama-like bf16 checkpoint (K and V, every layer)."""
    config = json.loads((model / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * 2


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids of the vocabulary's words, the same for the same seed."""
    return [3 + (seed * 7919 + i * 104729 + (i * i) % 97) % (VOCAB - 3) for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spec_config(url: str, cpu_bytes: int = 256 << 20, **options: Any) -> str:
    """The --kv-transfer-config that puts HiCacheOffloadingSpec under vLLM."""
    extra = {
        "spec_name": "HiCacheOffloadingSpec",
        "spec_module_path": "hicache.integrations.vllm",
        "cpu_bytes_to_use": cpu_bytes,
        "url": url,
        **options,
    }
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


@dataclass
class ServerOptions:
    """How one vLLM server is started."""

    model: Path
    kv_transfer_config: str | None = None
    max_model_len: int = 8192
    gpu_blocks: int | None = None  # --num-gpu-blocks-override: vLLM's own KV cache, in blocks
    one_process: bool = True  # engine and worker in the API server's process (starts faster)
    extra_args: Sequence[str] = ()


class VllmServer:
    """A `vllm serve` subprocess on 127.0.0.1, stopped by pid."""

    def __init__(self, options: ServerOptions, log_path: Path) -> None:
        self.options = options
        self.port = free_port()
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._shm_before = _offload_regions()
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(options.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK_TOKENS), "--dtype", "bfloat16",
            "--max-model-len", str(options.max_model_len), "--enable-prompt-tokens-details",
            "--served-model-name", "tiny",
            # No torch.compile warm-up (about 7 s of each start here); every server of the
            # tests runs eager, so outputs compare like with like.
            "--enforce-eager",
        ]  # fmt: skip
        if options.kv_transfer_config is not None:
            args += ["--kv-transfer-config", options.kv_transfer_config]
        if options.gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(options.gpu_blocks)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        if options.one_process:
            args += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        args += list(options.extra_args)
        self._log = open(log_path, "wb")  # noqa: SIM115  # closed in stop()
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until /health answers; RuntimeError with the log's tail if vLLM exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self._healthy():
                return
            time.sleep(1.0)
        raise RuntimeError(f"vLLM not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def wait_exit(self, timeout_s: float = START_TIMEOUT_S) -> int:
        """The exit status of a server expected to stop by itself."""
        return self.process.wait(timeout_s)

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples, by their full name with labels."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL) to the server's process group; SIGKILL after 60 s."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self._log.close()
        for path in _offload_regions() - self._shm_before:  # a killed vLLM leaves its region
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _offload_regions() -> set[Path]:
    return set(Path("/dev/shm").glob("vllm_offload_*.mmap"))


@contextlib.contextmanager
def running(options: ServerOptions, log_path: Path) -> Iterator[VllmServer]:
    server = VllmServer(options, log_path)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Completion:
    text: str
    cached_tokens: int


def complete(server: VllmServer, prompt: list[int], max_tokens: int = 8) -> Completion:
    """One greedy completion of a prompt given as token ids."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=600)
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0
    )
    details = reply.usage.prompt_tokens_details if reply.usage else None
    cached = (details.cached_tokens or 0) if details else 0
    return Completion(reply.choices[0].text, cached)
