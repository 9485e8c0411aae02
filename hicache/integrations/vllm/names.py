"""Storage names for vLLM offload keys.

A name is ``vllm-<format digest>-<offload key hex>``. The format digest covers everything that
makes a chunk's bytes differ (model, dtype, chunking, chunk size, the KV cache layout and the
kind of device whose KV it is, parallelism, rank), so an engine with another format never reads
a chunk it would misread: a CUDA engine's blocks are laid out unlike a CPU engine's.

No vLLM import here: the config is read by attribute.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hicache.keys import KEY_MAX_LEN, ValidKey, validate_key_prefix

__all__ = ["StorageNames", "format_fields"]

_DIGEST_CHARS = 16  # 64 bits: formats of one deployment, not an adversary's choice


def format_fields(config: Any, chunk_bytes: int, device: str) -> dict[str, object]:
    """The fields of a vLLM ``OffloadingConfig`` that change a chunk's stored bytes, with the
    kind of ``device`` the engine computes on (``cpu``, ``cuda``, ...)."""
    parallel = config.parallel
    return {
        "model": str(config.model.name),
        "dtype": str(config.model.dtype),
        "device": device,
        # vLLM 0.32 names the resolved layout here; 0.33 does not (None for all its engines).
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        "chunk_bytes": int(chunk_bytes),
        "replicated_layout": bool(config.replicated_layout),
        "tp_size": int(parallel.tp_size),
        "pp_size": int(parallel.pp_size),
        "pcp_size": int(parallel.pcp_size),
        "dcp_size": int(parallel.dcp_size),
        "rank": int(parallel.rank),
    }


class StorageNames:
    """Maps offload keys (bytes) to validated hicache keys of one format."""

    def __init__(self, fields: dict[str, object]) -> None:
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        self.digest = hashlib.sha256(b"hicache-vllm-format-v1\0" + blob).hexdigest()[:_DIGEST_CHARS]
        self.prefix = validate_key_prefix(f"vllm-{self.digest}-")
        self._room = KEY_MAX_LEN - len(self.prefix)

    def name(self, key: bytes) -> ValidKey:
        """The storage key of one offload key (on every lookup's probe: kept cheap)."""
        tail = key.hex()
        if len(tail) > self._room:
            # An unusually long key: its hash stands in (the 'h' keeps it apart from raw hex).
            tail = "h" + hashlib.sha256(key).hexdigest()
        # A checked prefix and lowercase hex: a valid key by construction, not checked again.
        return ValidKey(self.prefix + tail)
