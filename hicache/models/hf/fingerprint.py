"""A short identity of a model's weights, for the L3 keys of a cache shared across restarts.

Page keys already carry the KV's dtype, layout and shapes, but two checkpoints of one
architecture (a base model and its fine-tune, or two seeds) have the same shapes and different
KV for the same tokens: each needs its own namespace, or one reads the other's pages as hits.
Hashing whole checkpoints would take minutes for large ones, so the fingerprint reads what
differs between any two trainings: ``config.json``, every safetensors file's size and header,
and 1 MiB of tensor data at its start, middle and end.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["checkpoint_fingerprint", "config_fingerprint"]

_SAMPLE_BYTES = 1 << 20
_DIGEST_CHARS = 16


def checkpoint_fingerprint(directory: Path, files: Iterable[Path]) -> str:
    """The hex digest of ``directory``'s config and the sampled safetensors ``files``."""
    digest = hashlib.sha256()
    digest.update((directory / "config.json").read_bytes())
    for path in sorted(set(files)):
        digest.update(path.name.encode())
        _sample(path, digest)
    return digest.hexdigest()[:_DIGEST_CHARS]


def config_fingerprint(config: dict[str, Any]) -> str:
    """The hex digest of a seeded model's full config (its seed included)."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_CHARS]


def _sample(path: Path, digest: Any) -> None:
    size = os.path.getsize(path)
    digest.update(size.to_bytes(8, "little"))
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        digest.update(handle.read(min(header_len, size)))
        data = 8 + header_len
        for at in (data, data + (size - data) // 2, max(data, size - _SAMPLE_BYTES)):
            handle.seek(at)
            digest.update(handle.read(_SAMPLE_BYTES))
