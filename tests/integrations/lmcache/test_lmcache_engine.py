"""Two LMCache instances sharing one hicache store: StorageManager and LMCacheEngine, CPU only."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lmcache", reason="LMCache is installed only in the LMCache venv (.venv-lmcache)"
)

import torch
import yaml
from closing_kit import closed_on_exit
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache_kit import (
    CHUNK,
    HEAD_DIM,
    HEADS,
    LAYERS,
    CopyGPUConnector,
    chunk_key,
    connector_of,
    fill,
    lmcache_config,
    lmcache_metadata,
    plugin_extra,
    run_on,
    wait_stored,
)

REMOTE = "RemoteBackend-hicache"


@pytest.fixture
def managers() -> Iterator[list[StorageManager]]:
    with closed_on_exit(StorageManager.close) as made:
        yield made


def _manager(url: str, made: list[StorageManager]) -> StorageManager:
    manager = StorageManager(lmcache_config(url), lmcache_metadata(), EventManager())
    made.append(manager)
    assert REMOTE in manager.storage_backends, "LMCache did not load the hicache plugin"
    return manager


@pytest.mark.parametrize("scheme", ["file", "disk"])
def test_storage_manager_chunks_are_found_and_read_by_a_second_instance(
    tmp_path: Path, managers: list[StorageManager], scheme: str
) -> None:
    """Two managers open at once on one store (on ``disk://``, two writer slots)."""
    first = _manager(f"{scheme}://{tmp_path}", managers)
    metadata = lmcache_metadata()
    keys = [chunk_key(h) for h in (101, 102, 103, 104)]
    objs = [first.allocate(metadata.get_shapes(), metadata.get_dtypes()) for _ in keys]
    expected = [fill(obj, seed) for seed, obj in enumerate(objs)]
    first.batched_put(keys, objs)
    wait_stored(first.storage_backends[REMOTE], keys)

    second = _manager(f"{scheme}://{tmp_path}", managers)
    hits, where = second.batched_contains([*keys, chunk_key(999)])
    assert hits == 4 and list(where) == [REMOTE]  # its own CPU cache is empty
    got = second.batched_get(keys, location=REMOTE)
    for obj, want in zip(got, expected, strict=True):
        assert obj is not None and torch.equal(obj.tensor, want)
        obj.ref_count_down()
    assert connector_of(second.storage_backends[REMOTE]).stats()["hits"] == 4


# ----- LMCacheEngine --------------------------------------------------------------------------
class Engines:
    """LMCache engines built by LMCache's builder, destroyed at the end of the test."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def make(self, config: Any) -> Any:
        instance_id = f"hicache-test-{uuid.uuid4().hex[:8]}"
        shape = (LAYERS, 2, CHUNK, HEADS, HEAD_DIM)
        engine = LMCacheEngineBuilder.get_or_create(
            instance_id,
            config,
            lmcache_metadata(),
            CopyGPUConnector(shape),
            lambda *args: None,
            lambda *args: None,
        )
        self.ids.append(instance_id)
        engine.post_init()
        assert REMOTE in engine.storage_manager.storage_backends
        return engine


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    yield made
    for instance_id in made.ids:
        LMCacheEngineBuilder.destroy(instance_id)


def _config_file(tmp_path: Path, store: Path) -> LMCacheEngineConfig:
    """The configuration as a user writes it (the YAML of docs/engines.md)."""
    text = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.02,
        "save_unfull_chunk": True,
        "remote_serde": "naive",
        "remote_storage_plugins": ["hicache"],
        "extra_config": plugin_extra(f"file://{store}"),
    }
    path = tmp_path / f"lmcache-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(text))
    return LMCacheEngineConfig.from_file(str(path))


def _store(engine: Any, tokens: torch.Tensor, kv: torch.Tensor) -> list[Any]:
    """Store through the engine and wait for the remote writes; the chunks' keys."""
    engine.store(tokens, kvcaches=kv)
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
    wait_stored(engine.storage_manager.storage_backends[REMOTE], keys)
    return keys


def test_engine_store_lookup_retrieve_across_instances(tmp_path: Path, engines: Engines) -> None:
    tokens = torch.arange(3 * CHUNK + 5)  # three full chunks and a last one of 5 tokens
    kv = torch.randn(2, LAYERS, len(tokens), HEADS * HEAD_DIM).to(torch.bfloat16)
    _store(engines.make(_config_file(tmp_path, tmp_path / "store")), tokens, kv)

    second = engines.make(_config_file(tmp_path, tmp_path / "store"))
    assert second.lookup(tokens) == len(tokens)
    out = torch.zeros_like(kv)
    retrieved = second.retrieve(tokens, kvcaches=out)
    assert bool(retrieved.all())
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    assert connector_of(second.storage_manager.storage_backends[REMOTE]).stats()["hits"] == 4


def test_engine_retrieves_only_the_prefix_before_a_corrupt_chunk(
    tmp_path: Path, engines: Engines
) -> None:
    tokens = torch.arange(3 * CHUNK)
    kv = torch.randn(2, LAYERS, len(tokens), HEADS * HEAD_DIM).to(torch.bfloat16)
    first = engines.make(_config_file(tmp_path, tmp_path / "store"))
    keys = _store(first, tokens, kv)
    connector = connector_of(first.storage_manager.storage_backends[REMOTE])
    assert sorted(run_on(connector.loop, connector.list())) == sorted(k.to_string() for k in keys)
    name = connector.storage_name(keys[1])
    (data,) = run_on(connector.loop, connector.backend.get([name]))
    damaged = bytearray(data)
    damaged[-1] ^= 0xFF
    assert run_on(connector.loop, connector.backend.put([name], [bytes(damaged)])) == [True]

    second = engines.make(_config_file(tmp_path, tmp_path / "store"))
    assert second.lookup(tokens) == 3 * CHUNK  # the object exists; its bytes are not checked
    out = torch.zeros_like(kv)
    retrieved = second.retrieve(tokens, kvcaches=out)
    assert retrieved.tolist() == [True] * CHUNK + [False] * (2 * CHUNK)
    assert torch.equal(out[:, :, :CHUNK], kv[:, :, :CHUNK])
    assert not out[:, :, CHUNK:].any(), "KV past the corrupt chunk must be left alone"
    assert connector_of(second.storage_manager.storage_backends[REMOTE]).stats()["bad_pages"] == 1
