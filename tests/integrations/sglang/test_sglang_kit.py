"""SGLang's own unified-radix-cache kit (shipped in its wheel) drives the adapter: a producer
tree backs a sequence up to L3 through it, a consumer tree with empty pools prefetches the
sequence and loads it into its device pool."""

from __future__ import annotations

import asyncio
import json
from unittest import mock

import pytest

pytest.importorskip(
    "sglang", reason="SGLang is installed only in the SGLang venv (make test-sglang)"
)

import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler
import torch
from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
from sglang.srt.managers.cache_controller import get_storage_hash_str
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.fixtures import (
    drop_hicache_atexit_pin,
    match_prefix,
)
from sglang.test.kits.unified_radix_cache.storage import (
    UnifiedRadixCacheStorageFixtures,
)
from sglang.test.test_utils import CustomTestCase
from sglang_kit import one_rank, torch_device_copies

from hicache.backends.registry import open_backend
from hicache.integrations.sglang import extra_config

PAGES = 5


class _KitOverHicache(UnifiedRadixCacheStorageFixtures):
    """The kit's "file" storage fixtures, with SGLang's dynamic loader pointed at the adapter."""

    layout = "layer_first"
    cfg = CacheConfig(page_size=4, num_layers=4, full_attention_layer_ids=(0, 1, 2, 3))

    def setUp(self) -> None:
        super().setUp()
        self._enter(
            mock.patch(
                "sglang.test.kits.unified_radix_cache.fixtures.get_device", return_value="cpu"
            )
        )
        self._enter(one_rank())
        original = assembler.get_mha_host_pool_cls

        def unpinned(info):  # page-locked host memory needs CUDA
            cls = original(info)
            return lambda *args, **kw: cls(*args, **{**kw, "pin_memory": False})

        self._enter(mock.patch.object(assembler, "get_mha_host_pool_cls", side_effect=unpinned))
        self._enter(torch_device_copies())

    def _enter(self, context) -> None:
        context.__enter__()
        self.addCleanup(context.__exit__, None, None, None)

    def _init_hicache(self, cache, *, storage_backend=None, storage_dir=None, **_ignored):
        extra = extra_config(f"file://{storage_dir}", prefetch_threshold=1)
        server_args = ServerArgs(
            model_path="dummy",
            page_size=self.cfg.page_size,
            hicache_io_backend="direct",
            hicache_mem_layout=self.layout,
            hicache_write_policy="write_through",
            hicache_storage_backend="dynamic" if storage_backend else None,
            hicache_storage_backend_extra_config=json.dumps(extra) if storage_backend else None,
            hicache_storage_prefetch_policy="wait_complete",
        )
        server_args._mamba_cache_chunk_size = max(CHUNK_SIZE, self.cfg.page_size)
        set_global_server_args_for_scheduler(server_args)
        cache.init_hicache(server_args, cache.cache_init_params)
        self.addCleanup(drop_hicache_atexit_pin, cache)
        self.addCleanup(cache.release_host_resources)
        cache.write_through_threshold = 1 << 30
        cache.load_back_threshold = 0
        controller = cache.cache_controller
        controller.prefetch_capacity_limit = max(
            controller.prefetch_capacity_limit, controller.mem_pool_host.size
        )
        self.addCleanup(controller._stop_storage_threads)

    def _consumer_kv(self, storage_dir, seq):
        """Prefetch ``seq`` into a fresh tree, load what it found to the device, snapshot it."""
        consumer, allocator, _ = self._l3_consumer(storage_dir)
        self._consume_prefetch(consumer, seq, CacheRequestHandle("consumer", 0))
        match = match_prefix(consumer, seq)
        if match.host_hit_length == 0:
            return match.host_hit_length, None
        device_value = self._load_back_node(consumer, match.last_host_node)
        return match.host_hit_length, self._snapshot_full_kv(allocator, device_value)

    def test_consumer_device_kv_equals_the_producers(self) -> None:
        storage_dir = self._make_storage_dir()
        seq = self._make_seq(1, PAGES)
        expected = self._l3_produce(storage_dir, seq, marker=7.0)
        hit, got = self._consumer_kv(storage_dir, seq)
        self.assertEqual(hit, len(seq))
        self.assertTrue(torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1]))
        self.assertTrue(bool((got[0] == 7.0).all()), "the consumer's KV is the producer's marker")

    def test_partial_l3_prefix_gives_exactly_that_prefix(self) -> None:
        storage_dir = self._make_storage_dir()
        seq = self._make_seq(1, PAGES)
        page = self.cfg.page_size
        expected = self._l3_produce(storage_dir, seq[: 3 * page], marker=5.0)
        hit, got = self._consumer_kv(storage_dir, seq)
        self.assertEqual(hit, 3 * page)
        self.assertTrue(torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1]))

    def test_a_corrupt_middle_page_cuts_the_prefix_there(self) -> None:
        storage_dir = self._make_storage_dir()
        seq = self._make_seq(1, PAGES)
        page = self.cfg.page_size
        expected = self._l3_produce(storage_dir, seq, marker=3.0)
        third = get_storage_hash_str(seq, None, page_size=page)[2]
        asyncio.run(_damage_objects(storage_dir, third))
        hit, got = self._consumer_kv(storage_dir, seq)
        self.assertEqual(hit, 2 * page)
        self.assertTrue(torch.equal(expected[0][: 2 * page], got[0]))


async def _damage_objects(storage_dir: str, engine_key: str) -> None:
    """Flip a payload byte of every stored object whose key ends with ``engine_key``."""
    backend = await open_backend(f"file://{storage_dir}")
    try:
        keys = [info.key async for info in backend.scan("sgl-") if info.key.endswith(engine_key)]
        assert keys, "the page to damage was stored"
        for key, data in zip(keys, await backend.get(keys), strict=True):
            damaged = bytearray(data)
            damaged[-1] ^= 0xFF
            await backend.put([key], [bytes(damaged)])
    finally:
        await backend.close()


class TestKitLayerFirst(_KitOverHicache, CustomTestCase):
    layout = "layer_first"


class TestKitPageFirstDirect(_KitOverHicache, CustomTestCase):
    layout = "page_first_direct"
