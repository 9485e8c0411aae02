"""Bad stored objects are misses, never wrong KV or an exception; bad config fails at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lmcache", reason="LMCache is installed only in the LMCache venv (.venv-lmcache)"
)

import torch
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from lmcache_kit import (
    HEAD_DIM,
    LAYERS,
    Node,
    chunk_key,
    fill,
    lmcache_config,
    lmcache_metadata,
    plugin_extra,
    run_on,
)

from hicache.codec import HEADER_SIZE, PageMeta, encode_page
from hicache.dtypes import DType
from hicache.errors import BackendNotFoundError, ConfigError
from hicache.integrations.lmcache import LMCacheConfigError


def _stored(node: Node, seed: int = 0) -> tuple[Any, str, bytes]:
    """A chunk put through LMCache: its key, its storage name and the stored object."""
    key = chunk_key(1000 + seed)
    obj = node.allocate()
    fill(obj, seed)
    node.put(key, obj)
    obj.ref_count_down()
    name = node.connector.storage_name(key)
    (data,) = run_on(node.remote.loop, node.connector.backend.get([name]))
    assert data is not None
    return key, name, data


def _replace(node: Node, name: str, data: bytes) -> None:
    assert run_on(node.remote.loop, node.connector.backend.put([name], [data])) == [True]


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


BAD_OBJECTS: dict[str, Callable[[bytes], bytes]] = {
    "payload-bit-flip": lambda d: _flip(d, len(d) - 3),
    "header-bit-flip": lambda d: _flip(d, 40),
    "truncated": lambda d: d[:-7],
    "header-only": lambda d: d[:HEADER_SIZE],
    "empty": lambda d: b"",
    "garbage": lambda d: b"not a page at all" * 200,
    "too-long": lambda d: d + b"\0" * 64,
}


@pytest.mark.parametrize("damage", BAD_OBJECTS.values(), ids=BAD_OBJECTS.keys())
def test_damaged_object_is_a_miss(damage: Callable[[bytes], bytes], node: Node) -> None:
    key, name, data = _stored(node)
    _replace(node, name, damage(data))
    assert node.remote.get_blocking(key) is None
    assert node.remote.batched_get_blocking([key]) == [None]
    assert node.connector.stats()["bad_pages"] == 2


def test_object_copied_under_another_key_is_foreign(node: Node) -> None:
    key_a, _, data_a = _stored(node, seed=1)
    key_b, name_b, _ = _stored(node, seed=2)
    _replace(node, name_b, data_a)  # A's bytes, perfectly valid, under B's name
    assert node.remote.get_blocking(key_b) is None
    got = node.remote.get_blocking(key_a)
    assert got is not None
    got.ref_count_down()


def test_page_of_another_shape_under_the_right_name_is_a_miss(node: Node) -> None:
    key, name, data = _stored(node)
    payload = data[HEADER_SIZE:]
    # Same bytes, but declared as a chunk of another layout: a reader must not take it.
    other = PageMeta("KV_2LTD", DType.BFLOAT16, (2, LAYERS, 8, 2 * 2 * HEAD_DIM))
    _replace(node, name, b"".join(bytes(s) for s in encode_page(name, payload, other)))
    assert node.remote.get_blocking(key) is None


def test_engine_with_another_kv_shape_never_sees_the_chunks(
    tmp_path: Path, make_node: Callable[..., Node]
) -> None:
    writer = make_node(f"file://{tmp_path}")
    key, _, _ = _stored(writer)
    reader = make_node(f"file://{tmp_path}", metadata=lmcache_metadata(heads=4))
    assert writer.remote.contains(key)
    assert not reader.remote.contains(key)
    assert reader.remote.get_blocking(key) is None


def test_backend_failure_is_a_miss_not_an_exception(node: Node) -> None:
    key, _, _ = _stored(node)
    run_on(node.remote.loop, node.connector.backend.close())
    assert node.remote.get_blocking(key) is None
    assert node.remote.batched_get_blocking([key, chunk_key(7)]) == [None, None]
    assert node.remote.batched_contains([key]) == 0
    assert node.connector.stats()["read_errors"] == 2


# ----- configuration ----------------------------------------------------------------------------
@pytest.fixture
def cpu_backend() -> LocalCPUBackend:
    return LocalCPUBackend(lmcache_config("memory://"), lmcache_metadata(), "cpu")


def _connect(loop: asyncio.AbstractEventLoop, cpu: LocalCPUBackend, config: Any) -> Any:
    return CreateConnector(
        "plugin://hicache", loop, cpu, config, lmcache_metadata(), plugin_name="hicache"
    )


@pytest.mark.parametrize(
    "url",
    ["nosuch:///tmp/x", "just/a/path", "file:///tmp/x?no_such_option=1", "memory://host"],
)
def test_bad_url_raises_a_typed_error_naming_it(
    url: str, storage_loop: asyncio.AbstractEventLoop, cpu_backend: LocalCPUBackend
) -> None:
    with pytest.raises(LMCacheConfigError) as caught:
        _connect(storage_loop, cpu_backend, lmcache_config(url))
    assert isinstance(caught.value, ConfigError)
    assert "remote_storage_plugin.hicache.url" in str(caught.value) and url in str(caught.value)


def test_unknown_scheme_keeps_the_registry_error_as_cause(
    storage_loop: asyncio.AbstractEventLoop, cpu_backend: LocalCPUBackend
) -> None:
    with pytest.raises(LMCacheConfigError) as caught:
        _connect(storage_loop, cpu_backend, lmcache_config("nosuch:///tmp/x"))
    assert isinstance(caught.value.__cause__, BackendNotFoundError)


def test_remote_backend_construction_fails_instead_of_retrying(
    storage_loop: asyncio.AbstractEventLoop, cpu_backend: LocalCPUBackend
) -> None:
    config = lmcache_config("nosuch:///tmp/x")
    with pytest.raises(LMCacheConfigError):
        RemoteBackend(config, lmcache_metadata(), storage_loop, cpu_backend, "cpu", "hicache")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"extra_config": {k: v for k, v in plugin_extra("x://").items() if "url" not in k}},
            "remote_storage_plugin.hicache.url",
        ),
        ({"remote_serde": "cachegen"}, "remote_serde"),
        ({"use_layerwise": True}, "use_layerwise"),
    ],
    ids=["no-url", "serde", "layerwise"],
)
def test_unsupported_config_is_refused(
    overrides: dict[str, Any],
    message: str,
    tmp_path: Path,
    storage_loop: asyncio.AbstractEventLoop,
    cpu_backend: LocalCPUBackend,
) -> None:
    with pytest.raises(LMCacheConfigError, match=message):
        _connect(storage_loop, cpu_backend, lmcache_config(f"file://{tmp_path}", **overrides))


def test_kv_dtype_without_a_page_dtype_is_refused(
    tmp_path: Path, storage_loop: asyncio.AbstractEventLoop, cpu_backend: LocalCPUBackend
) -> None:
    config = lmcache_config(f"file://{tmp_path}")
    with pytest.raises(LMCacheConfigError, match="dtype"):
        CreateConnector(
            "plugin://hicache",
            storage_loop,
            cpu_backend,
            config,
            lmcache_metadata(dtype=torch.float8_e4m3fnuz),
            plugin_name="hicache",
        )
