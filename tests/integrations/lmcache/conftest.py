"""Fixtures for the LMCache plugin tests: a storage loop and LMCache storage nodes on it.

The tests run in the LMCache venv (engines/lmcache-requirements.txt) and skip elsewhere: each
test module skips itself when lmcache is missing. This file imports LMCache only inside its
fixtures, since a conftest that skipped at import would abort a run naming this directory.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from redis_engine_kit import redis_server, redis_url  # noqa: F401 (fixtures)

if TYPE_CHECKING:
    from lmcache_kit import Node


@pytest.fixture
def storage_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop run by its own thread, as LMCache's StorageManager runs one."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-storage-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def make_node(storage_loop: asyncio.AbstractEventLoop) -> Iterator[Callable[..., Node]]:
    from lmcache_kit import Node, lmcache_config, lmcache_metadata

    nodes: list[Node] = []

    def make(url: str, metadata: Any = None, **overrides: Any) -> Node:
        node = Node(storage_loop, lmcache_config(url, **overrides), metadata or lmcache_metadata())
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        if node.remote.connection is not None:
            node.remote.close()


@pytest.fixture
def node(tmp_path: Path, make_node: Callable[..., Node]) -> Node:
    """A node over a ``file://`` store in the test's own directory."""
    return make_node(f"file://{tmp_path}")
