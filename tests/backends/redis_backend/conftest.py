"""Real ``redis-server`` processes for the ``redis://`` tests, each kind started once a session.

Every server runs on a free 127.0.0.1 port in a temporary directory, saves nothing, and is
stopped by pid at the end. Without ``redis-server`` (``apt-get install redis-server``) every
test here is skipped with that reason. Tests keep to key prefixes of their own, so they share
servers; a test that damages a server (stops it, fills it) starts one of its own.
"""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
from redis_kit import ACL_PASSWORD, ACL_USER, DEFAULT_PASSWORD, MAX_BULK, SKIP_REASON, open_redis

from hicache.tools.services.redis import RedisCluster, RedisServer, RedisTls, redis_cluster

# The test modules import redis-py (the redis extra, which `make test` installs): without it,
# there is nothing here to run.
collect_ignore_glob = [] if importlib.util.find_spec("redis") else ["test_*.py"]


def _needs_redis() -> None:
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)


@pytest.fixture(scope="session")
def redis_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("redis")


@pytest.fixture(scope="session")
def single_server(redis_dir: pathlib.Path) -> Iterator[RedisServer]:
    """A plain server; DEBUG is on for the timeout test."""
    _needs_redis()
    args = ["--proto-max-bulk-len", str(MAX_BULK), "--enable-debug-command", "local"]
    with RedisServer(str(redis_dir), args) as server:
        yield server


@pytest.fixture(scope="session")
def auth_server(redis_dir: pathlib.Path) -> Iterator[RedisServer]:
    _needs_redis()
    acl = ["--user", ACL_USER, "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all", "-@dangerous"]
    with RedisServer(str(redis_dir), acl, password=DEFAULT_PASSWORD) as server:
        yield server


@pytest.fixture(scope="session")
def tls_server(redis_dir: pathlib.Path) -> Iterator[RedisServer]:
    _needs_redis()
    from tls_kit import self_signed  # tests/tls_kit.py: a certificate for 127.0.0.1

    files = self_signed(redis_dir)
    tls = RedisTls(files.certfile, files.keyfile, files.certfile)
    with RedisServer(str(redis_dir), tls=tls) as server:
        yield server


@pytest.fixture(scope="session")
def cluster(redis_dir: pathlib.Path) -> Iterator[RedisCluster]:
    _needs_redis()
    with redis_cluster(str(redis_dir / "cluster"), masters=3) as started:
        yield started


@pytest.fixture
def own_server(tmp_path: pathlib.Path) -> Iterator[RedisServer]:
    """A server for one test, to stop, fill or restart."""
    _needs_redis()
    with RedisServer(str(tmp_path)) as server:
        yield server


@pytest_asyncio.fixture
async def backend(single_server: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A store of its own (a key prefix named after the test) on the shared server."""
    opened = await open_redis(single_server.url(key_prefix=f"t-{request.node.name[:40]}:"))
    yield opened
    await opened.close()
