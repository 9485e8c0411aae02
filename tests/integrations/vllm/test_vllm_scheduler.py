"""HiCacheTier behind vLLM's own Scheduler: the OffloadingConnector with the tiering spec, a CPU
tier too small to keep a prefix, and a second request whose external hit comes from hicache.

vLLM's scheduler side runs on CPU (VLLM_TARGET_DEVICE=cpu, as ``make test-vllm`` sets it); its
worker side needs CUDA, so the test plays the worker: each step it applies the step's load and
store jobs between a fake GPU KV (a byte row per block) and vLLM's CPU tier, writes each newly
computed block's bytes (a digest of its tokens), and reports the jobs done as a worker would.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is installed only in the vLLM venv (make test-vllm)",
)

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.platforms import current_platform
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hicache.integrations.vllm import HiCacheTier

BLOCK = 16  # tokens per GPU block, and per offloaded chunk
GPU_BLOCKS = 64
CPU_CHUNKS = 8  # the CPU tier: room for 8 chunks only
CHUNK_BYTES = 4096  # what vLLM's CPU tier gives a chunk here (a block's bytes, page-padded)

if not current_platform.is_cpu():
    pytest.skip("vLLM's scheduler runs on CPU with VLLM_TARGET_DEVICE=cpu", allow_module_level=True)


def model_dir(root: Path) -> str:
    """A model directory with only a config.json: the scheduler reads nothing else."""
    from transformers import OPTConfig

    OPTConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=1, ffn_dim=128,
        num_attention_heads=1, max_position_embeddings=2048, word_embed_proj_dim=64,
        architectures=["OPTForCausalLM"], torch_dtype="float16",
    ).save_pretrained(root)  # fmt: skip
    return str(root)


def build_scheduler(root: Path, url: str) -> Scheduler:
    tier = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm", "url": url}
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": CPU_CHUNKS * CHUNK_BYTES,
        "secondary_tiers": [tier],
    }
    model = ModelConfig(model=model_dir(root / "model"), dtype="float16", seed=0)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"  # set by layout resolution before connectors are built
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=512,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
        device_config=DeviceConfig("cpu"),
    )
    layer = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=GPU_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], layer)],
    )
    config.cache_config.num_gpu_blocks = GPU_BLOCKS
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def block_bytes(tokens: list[int], width: int) -> np.ndarray:
    """What the fake model computes for one block: a digest of its tokens, spread to a row."""
    seed = hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()
    return np.frombuffer((seed * (width // len(seed) + 1))[:width], dtype=np.uint8)


class FakeWorker:
    """Plays vLLM's GPU worker and model for the scheduler, one step at a time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.manager = scheduler.connector.connector_scheduler.manager
        view = self.manager.primary_tier.get_kv_memoryview()
        self.cpu = np.asarray(view).view(np.uint8)  # vLLM's CPU tier, zero-copy
        assert self.cpu.shape == (CPU_CHUNKS, CHUNK_BYTES)
        self.gpu = np.zeros((GPU_BLOCKS, CHUNK_BYTES), dtype=np.uint8)
        self.loaded: dict[str, list[bool]] = {}  # request -> each loaded block right?

    def step(self) -> None:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        done = OffloadingWorkerMetadata()
        received: set[str] = set()
        for job_id, job in meta.load_jobs.items():
            self.gpu[job.dst_spec.block_ids] = self.cpu[job.src_spec.block_ids]
            self._check_loaded(job.req_id, job.dst_spec.block_ids)
            done.mark_completed(job_id)
            received.add(job.req_id)
        self._compute(out)
        for job_id, job in meta.store_jobs.items():
            self.cpu[job.dst_spec.block_ids] = self.gpu[job.src_spec.block_ids]
            done.mark_completed(job_id)
        running = [r.request_id for r in self.scheduler.running]
        # Finished requests whose blocks vLLM kept for their stores: those are done now.
        sent = {rid for rid in out.finished_req_ids if rid in self.scheduler.requests}
        connector = KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=received or None,
            invalid_block_ids=set(),
            kv_connector_worker_meta=done,
        )
        result = ModelRunnerOutput(
            req_ids=running,
            req_id_to_index={rid: i for i, rid in enumerate(running)},
            sampled_token_ids=[[7] for _ in running],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=connector,
        )
        self.scheduler.update_from_output(out, result)

    def _compute(self, out: Any) -> None:
        """Write the blocks this step completes: the fake forward pass."""
        for rid, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            start = request.num_computed_tokens - count  # schedule() already counted them
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
            tokens = request.all_token_ids
            for b in range(start // BLOCK, (start + count) // BLOCK):
                self.gpu[blocks[b]] = block_bytes(tokens[b * BLOCK : (b + 1) * BLOCK], CHUNK_BYTES)

    def _check_loaded(self, rid: str, gpu_blocks: np.ndarray) -> None:
        request = self.scheduler.requests[rid]
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        tokens = request.all_token_ids
        starts = [blocks.index(block) * BLOCK for block in gpu_blocks.tolist()]
        self.loaded[rid] = [
            np.array_equal(self.gpu[block], block_bytes(tokens[at : at + BLOCK], CHUNK_BYTES))
            for block, at in zip(gpu_blocks.tolist(), starts, strict=True)
        ]

    def run(self, request: Request, timeout_s: float = 60.0) -> None:
        """Add ``request`` and step until it finished and no transfer is left. Steps are paced:
        a lookup's answer comes from the tier's own thread, which a busy machine may not run
        for a while, and vLLM asks again each step meanwhile."""
        self.scheduler.add_request(request)
        connector = self.scheduler.connector.connector_scheduler
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.scheduler.requests and not connector._jobs:
                (tier,) = self.manager.secondary_tiers
                tier.drain_jobs()
                if not self.manager._jobs:
                    return
            self.step()
            time.sleep(0.002)
        raise AssertionError(f"{request.request_id} did not finish in {timeout_s} s")


@pytest.fixture
def hashing() -> Iterator[None]:
    init_none_hash(sha256)
    yield


def request(rid: str, tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=2)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def test_second_request_hits_hicache_after_the_cpu_tier_dropped_it(
    tmp_path: Path, hashing: None
) -> None:
    scheduler = build_scheduler(tmp_path, f"disk://{tmp_path / 'store'}")
    worker = FakeWorker(scheduler)
    connector = scheduler.connector.connector_scheduler
    (tier,) = worker.manager.secondary_tiers
    assert isinstance(tier, HiCacheTier)
    hits: dict[str, int] = {}
    matched = connector.get_num_new_matched_tokens

    def spy(req: Request, computed: int, **kwargs: Any) -> Any:
        found = matched(req, computed, **kwargs)
        if found[0]:
            hits[req.request_id] = found[0]
        return found

    connector.get_num_new_matched_tokens = spy
    loads: list[list[bytes]] = []
    submit_load = tier.submit_load
    tier.submit_load = lambda job: (loads.append(list(job.keys)), submit_load(job))[1]
    prefix = [100 + i for i in range(4 * BLOCK)]
    try:
        worker.run(request("a", [*prefix, 1, 2, 3]))
        for n in range(2):  # other prompts take the CPU tier's room: a's chunks leave it
            start = 1000 * (n + 1)
            worker.run(request(f"filler-{n}", [*range(start, start + 6 * BLOCK), 4]))
        assert scheduler.reset_prefix_cache()  # the GPU's own prefix cache forgets the prefix
        worker.run(request("b", [*prefix, 9, 9]))
    finally:
        del worker.cpu
        scheduler.shutdown()
    assert hits.get("b") == 4 * BLOCK  # the whole shared prefix came from outside the GPU
    assert loads and len(loads[0]) == 4  # promoted from the hicache tier into the CPU tier
    assert worker.loaded["b"] == [True] * 4  # and loaded byte-exact into b's GPU blocks
    assert set(hits) == {"b"}
