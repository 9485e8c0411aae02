"""Real SGLang objects for the adapter tests: device and host pools, storage configs, the
dynamic loader, and torch copies standing in for SGLang's CUDA device-host kernels."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.runtime_context import get_parallel

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4
LAYERS = 3
DEVICE_TOKENS = 64


def one_rank() -> Any:
    """SGLang's parallel state for a single rank (no process groups are built in the tests)."""
    return get_parallel().override(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )


def storage_config(
    extra: dict[str, Any], *, mla: bool = False, layout: str = "page_first", **ranks: int
) -> HiCacheStorageConfig:
    fields: dict[str, Any] = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1
    )
    fields.update(ranks)
    return HiCacheStorageConfig(
        **fields,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first",
        model_name=str(extra.pop("model_name", "org/tiny-model")),
        extra_config=extra,
    )


def host_pool_over(host_type: Any, device: Any, page: int, layout: str, **extra: Any) -> Any:
    """A host pool of ``host_type`` over ``device``'s layers: twice its tokens, not pinned."""
    info = device.get_device_pool_infos()[0].buffer_info
    return host_type(
        info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        **extra,
    )


def mha_pools(
    layout: str, dtype: torch.dtype = torch.bfloat16, heads: int = 2, page: int = PAGE
) -> tuple[Any, Any]:
    device = MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=page,
        dtype=dtype,
        head_num=heads,
        head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    return device, host_pool_over(MHATokenToKVPoolHost, device, page, layout)


def mla_pools(layout: str, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    device = MLATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=dtype,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    host = host_pool_over(
        MLATokenToKVPoolHost,
        device,
        PAGE,
        layout,
        override_kv_cache_dim=device.kv_cache_dim,
        target_layer_num=LAYERS,
    )
    return device, host


def fill_random(host: Any, seed: int) -> None:
    """Give every byte of the host pool a value from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 255, raw.shape, generator=generator, dtype=torch.uint8))


def page_bytes(host: Any, slot: int) -> bytes:
    return host.get_data_page(slot, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def create_storage(extra: dict[str, Any], host: Any, **config: Any) -> Any:
    """The adapter as SGLang's own factory makes it, with the host pool registered."""
    cfg = storage_config(dict(extra), layout=host.layout, **config)
    storage = StorageBackendFactory.create_backend("dynamic", cfg, host)
    storage.register_mem_pool_host(host)
    storage.on_host_pools_registered()
    return storage


def slots(pages: list[int]) -> torch.Tensor:
    """Token slots of whole pages, as SGLang's controller hands them to storage."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


@contextlib.contextmanager
def torch_device_copies() -> Iterator[None]:
    """SGLang's device-host copies as torch index copies: its kernels need CUDA."""

    def backup(
        self: Any, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any
    ) -> None:
        for layer in range(self.layer_num):
            for component, source in enumerate((self.device_k_buffers, self.device_v_buffers)):
                _write_rows(self, component, layer, host_indices, source[layer][device_indices])

    def load(
        self: Any,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: Any,
        *,
        is_draft: bool = False,
    ) -> None:
        for component, target in enumerate((self.device_k_buffers, self.device_v_buffers)):
            target[layer_id][device_indices] = _read_rows(self, component, layer_id, host_indices)

    with (
        mock.patch.object(MHATokenToKVPoolHost, "backup_from_device_all_layer", backup),
        mock.patch.object(MHATokenToKVPoolHost, "load_to_device_per_layer", load),
    ):
        yield


def _split(host: Any, tokens: Any) -> tuple[Any, Any]:
    tokens = tokens.to(torch.int64)
    return tokens // host.page_size, tokens % host.page_size


def _read_rows(host: Any, component: int, layer: int, tokens: Any) -> Any:
    kv = host.kv_buffer[component]
    if host.layout == "layer_first":
        return kv[layer][tokens]
    if host.layout == "page_first":
        return kv[:, layer][tokens]
    page, offset = _split(host, tokens)
    if host.layout == "page_first_direct":
        return kv[page, layer, offset]
    return kv[page, :, offset, layer]  # page_head: (tokens, heads, dim)


def _write_rows(host: Any, component: int, layer: int, tokens: Any, rows: Any) -> None:
    kv = host.kv_buffer[component]
    if host.layout == "layer_first":
        kv[layer][tokens] = rows
    elif host.layout == "page_first":
        kv[:, layer][tokens] = rows
    else:
        page, offset = _split(host, tokens)
        if host.layout == "page_first_direct":
            kv[page, layer, offset] = rows
        else:
            kv[page, :, offset, layer] = rows
