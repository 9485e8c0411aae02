"""The tiered cache with the device tier on CUDA: per-layer load events and exact KV.

Plain (not async) tests that run their own event loop, so they also run where
pytest-asyncio is missing (tools/gpu_check.sh on a bare GPU image).
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch
from cuda_kit import needs_cuda
from tier_kit import PAGE, Harness

from hicache.keys import RadixKey

pytestmark = pytest.mark.cuda


@needs_cuda
def test_cuda_backup_evict_and_per_layer_load_back(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        async with await Harness.build(url=f"file://{tmp_path}", device_kind="cuda") as h:
            assert h.kv.buffer.is_cuda and h.host["kv"].pinned
            tokens = list(range(1, 8 * PAGE + 1))
            assert h.run_request("a", tokens)["computed"] == len(tokens)
            await h.settle()
            h.tree.evict(10_000)
            match = h.tree.match_prefix(RadixKey(tokens))
            assert (match.prefix_len, match.host_hit_length) == (0, len(tokens))
            slots, _ = h.tree.init_load_back(match.last_host_node)
            (load,) = h.tree.ready_to_load_host_cache()
            for layer in range(h.kv.buffer.shape[1]):
                load.wait_layer("kv", layer)  # the current stream waits for this layer only
            torch.cuda.current_stream().synchronize()
            h.check_prefix(tokens, slots)

    asyncio.run(scenario())


@needs_cuda
def test_cuda_restart_reads_l3_into_pinned_host_and_device(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        tokens = list(range(50, 50 + 6 * PAGE))
        first = await Harness.build(url=f"file://{tmp_path}", device_kind="cuda")
        first.run_request("a", tokens)
        await first.settle()
        await first.close()
        async with await Harness.build(url=f"file://{tmp_path}", device_kind="cuda") as h:
            key = RadixKey(tokens)
            assert h.tree.prefetcher.start("b", key, h.tree.match_prefix(key))
            await h.settle(lambda: h.tree.prefetcher.may_run("b"))
            assert h.run_request("b", tokens) == {"device": 0, "host": len(tokens), "computed": 0}

    asyncio.run(scenario())
