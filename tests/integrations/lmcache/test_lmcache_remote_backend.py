"""LMCache's own RemoteBackend, loading the plugin from its config, over hicache backends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lmcache", reason="LMCache is installed only in the LMCache venv (.venv-lmcache)"
)

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache_kit import CHUNK, Node, chunk_key, fill, run_on, wait_stored

from hicache.codec import HEADER_SIZE
from hicache.integrations.lmcache import connector as connector_module


@pytest.mark.parametrize("store", ["file", "redis"])
def test_put_get_contains_remove_through_remote_backend(
    tmp_path: Path, make_node: Callable[..., Node], request: pytest.FixtureRequest, store: str
) -> None:
    url = request.getfixturevalue("redis_url") if store == "redis" else f"file://{tmp_path}"
    node = make_node(url)
    key, absent = chunk_key(0x1234), chunk_key(0x5678)
    obj = node.allocate()
    expected = fill(obj, seed=1)
    node.put(key, obj)
    obj.ref_count_down()

    assert node.remote.contains(key) and not node.remote.contains(absent)
    got = node.remote.get_blocking(key)
    assert got is not None and got.tensor is not None
    assert got.get_shape() == expected.shape and got.get_dtype() == expected.dtype
    assert torch.equal(got.tensor.view(torch.uint8), expected.view(torch.uint8))
    got.ref_count_down()

    assert node.remote.remove(key)
    assert not node.remote.contains(key)
    assert node.remote.get_blocking(key) is None
    assert not node.remote.remove(key)


def test_batched_put_then_leading_hits_and_batched_get(node: Node) -> None:
    keys = [chunk_key(h) for h in (11, 12, 13)]
    objs = [node.allocate() for _ in keys]
    expected = [fill(obj, seed=i) for i, obj in enumerate(objs)]
    node.remote.batched_submit_put_task(keys, objs)
    wait_stored(node.remote, keys)

    gap = [keys[0], keys[1], chunk_key(99), keys[2]]
    assert node.remote.batched_contains(gap) == 2
    assert node.remote.batched_contains(keys) == 3
    assert run_on(node.remote.loop, node.remote.batched_async_contains("l1", gap)) == 2

    got = node.remote.batched_get_blocking([*keys, chunk_key(99)])
    assert got[3] is None
    for obj, want in zip(got[:3], expected, strict=True):
        assert obj is not None and torch.equal(obj.tensor, want)
        obj.ref_count_down()
    assert node.connector.stats()["hits"] == 3


def test_non_blocking_get_returns_the_prefix_before_the_first_miss(node: Node) -> None:
    keys = [chunk_key(h) for h in (21, 22, 23)]
    expected = []
    for i, key in enumerate((keys[0], keys[2])):
        obj = node.allocate()
        expected.append(fill(obj, seed=i))
        node.put(key, obj)
        obj.ref_count_down()
    got = run_on(node.remote.loop, node.remote.batched_get_non_blocking("l2", keys))
    assert len(got) == 1 and torch.equal(got[0].tensor, expected[0])
    got[0].ref_count_down()


def test_a_last_chunk_of_fewer_tokens_reads_back_with_its_shape(node: Node) -> None:
    key = chunk_key(31)
    obj = node.allocate(tokens=5)  # save_unfull_chunk stores such chunks
    expected = fill(obj, seed=3)
    node.put(key, obj)
    obj.ref_count_down()
    got = node.remote.get_blocking(key)
    assert got is not None and got.get_shape() == expected.shape
    assert got.get_shape()[2] == 5 < CHUNK
    assert torch.equal(got.tensor, expected)
    got.ref_count_down()


def test_list_returns_the_original_keys(node: Node) -> None:
    keys = [
        chunk_key(41),
        # No '@' in tag values: LMCache's own CacheEngineKey.from_string splits on it.
        chunk_key(-42, user="alice+x", adapter="lora/v1.2_final"),
        chunk_key(43, note="50% off; tab\there"),
    ]
    for i, key in enumerate(keys):
        obj = node.allocate()
        fill(obj, seed=i)
        node.put(key, obj)
        obj.ref_count_down()
    listed = run_on(node.remote.loop, node.connector.list())
    assert sorted(listed) == sorted(k.to_string() for k in keys)
    assert {CacheEngineKey.from_string(s) for s in listed} == set(keys)


def test_memory_backend_url(make_node: Callable[..., Node]) -> None:
    node = make_node("memory://")
    key = chunk_key(51)
    obj = node.allocate()
    expected = fill(obj, seed=5)
    node.put(key, obj)
    obj.ref_count_down()
    got = node.remote.get_blocking(key)
    assert got is not None and torch.equal(got.tensor, expected)
    got.ref_count_down()
    assert type(node.connector.backend).__name__ == "MemoryBackend"


def test_header_and_payload_move_without_a_join_copy(make_node: Callable[..., Node]) -> None:
    """The payload segment the backend gets (and fills) is the memory object's own memory."""
    node = make_node("memory://")
    backend = node.connector.backend
    seen: dict[str, list[list[memoryview]]] = {}
    real_put, real_get_into = backend._put, backend._get_into

    async def spy_put(keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        seen["put"] = values
        return await real_put(keys, values)

    async def spy_get_into(keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        seen["get"] = buffers
        return await real_get_into(keys, buffers)

    backend._put, backend._get_into = spy_put, spy_get_into  # type: ignore[method-assign]
    obj = node.allocate()
    fill(obj, seed=6)
    node.put(chunk_key(61), obj)
    put_segments = seen["put"][0]
    assert [s.nbytes for s in put_segments] == [HEADER_SIZE, obj.get_size()]
    assert _address(put_segments[1]) == obj.data_ptr
    obj.ref_count_down()

    got = node.remote.get_blocking(chunk_key(61))
    assert got is not None
    get_segments = seen["get"][0]
    assert [s.nbytes for s in get_segments] == [HEADER_SIZE, got.get_size()]
    assert _address(get_segments[1]) == got.data_ptr
    got.ref_count_down()


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_lookups_during_a_put_in_flight_do_not_ask_the_backend(
    make_node: Callable[..., Node],
) -> None:
    """LMCache polls its lookup while its writes run: a chunk still being put is a miss
    answered by the connector, and only the chunks before it are looked up in the store."""
    node = make_node("memory://")
    backend = node.connector.backend
    stored, waiting = chunk_key(71), [chunk_key(72), chunk_key(73)]
    first = node.allocate()
    fill(first, seed=7)
    node.put(stored, first)
    first.ref_count_down()

    asked: list[list[str]] = []
    started, release = threading.Event(), asyncio.Event()
    real_put, real_leading_hits = backend.put, backend.leading_hits

    async def held_put(keys: Any, values: Any) -> list[bool]:
        started.set()
        await release.wait()
        return await real_put(keys, values)

    async def counted_leading_hits(keys: Any, batch_size: int = 128) -> int:
        asked.append(list(keys))
        return await real_leading_hits(keys, batch_size)

    backend.put, backend.leading_hits = held_put, counted_leading_hits  # type: ignore[method-assign]
    objs = [node.allocate() for _ in waiting]
    for seed, obj in enumerate(objs):
        fill(obj, seed=seed)
    node.remote.batched_submit_put_task(waiting, objs)
    assert started.wait(10)

    assert node.remote.batched_contains(waiting) == 0
    assert not node.remote.contains(waiting[0])
    assert asked == []  # no round trip while the first key's put is in flight
    assert node.remote.batched_contains([stored, *waiting]) == 1
    assert asked == [[node.connector.storage_name(stored)]]

    node.remote.loop.call_soon_threadsafe(release.set)
    wait_stored(node.remote, waiting)
    assert node.remote.batched_contains([stored, *waiting]) == 3
    assert run_on(node.remote.loop, node.remote.batched_async_contains("l2", waiting)) == 2


def test_a_large_put_goes_in_groups_encoded_while_the_last_is_stored(
    make_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch over PUT_GROUP_BYTES is several backend puts of at most that many payload
    bytes, in order; every chunk reads back whole."""
    node = make_node("memory://")
    backend = node.connector.backend
    keys = [chunk_key(80 + i) for i in range(5)]
    objs = [node.allocate() for _ in keys]
    expected = [fill(obj, seed=i) for i, obj in enumerate(objs)]
    monkeypatch.setattr(connector_module, "PUT_GROUP_BYTES", 2 * objs[0].get_size())
    groups: list[int] = []
    real_put = backend.put

    async def counted_put(names: Any, values: Any) -> list[bool]:
        groups.append(len(names))
        return await real_put(names, values)

    backend.put = counted_put  # type: ignore[method-assign]
    node.remote.batched_submit_put_task(keys, objs)
    wait_stored(node.remote, keys)
    assert groups == [2, 2, 1]
    got = node.remote.batched_get_blocking(keys)
    for obj, want in zip(got, expected, strict=True):
        assert obj is not None and torch.equal(obj.tensor, want)
        obj.ref_count_down()
