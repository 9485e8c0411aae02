"""The conformance suite over a real Redis: a plain server, one with a password and an ACL user,
one with TLS, and a 3-master cluster.

Each test's store is a key prefix derived from its location on the shared server, so the same
location reopens the same store and a new one is empty. The raw hooks reach the server through
a redis-py client of their own, never through the backend.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any, ClassVar

import pytest
from redis_kit import ACL_PASSWORD, ACL_USER, DEFAULT_PASSWORD, MAX_BULK

from hicache.backends.base import StorageBackend
from hicache.backends.redis import RedisBackend
from hicache.backends.registry import open_backend
from hicache.backends.testing import BackendConformanceTests
from hicache.tools.services.redis import RedisCluster, RedisServer


def prefix_of(location: pathlib.Path) -> str:
    return "t" + hashlib.sha1(str(location).encode()).hexdigest()[:12] + ":"


class _RedisSuite(BackendConformanceTests):
    # Small: every byte crosses a socket (TLS included), and the session's time is short.
    large_object_bytes = 4 << 20
    state_machine_examples = 15
    url: str

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        backend = await open_backend(self.url, key_prefix=prefix_of(location))
        assert isinstance(backend, RedisBackend)
        return backend

    def raw_client(self) -> Any:
        raise NotImplementedError

    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        client = self.raw_client()
        try:
            data = await client.get(self._raw_key(backend, key))
        finally:
            await client.aclose()
        return None if data is None else bytes(data)

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        client = self.raw_client()
        try:
            await client.set(self._raw_key(backend, key), data)
        finally:
            await client.aclose()

    @staticmethod
    def _raw_key(backend: StorageBackend, key: str) -> bytes:
        assert isinstance(backend, RedisBackend)
        return (backend.config.key_prefix + key).encode()


class _OneServerSuite(_RedisSuite):
    """Over one server (not a cluster); each subclass's autouse fixture sets ``server`` and
    ``url``. The raw hooks connect as the default user, with ``raw_password`` if it has one."""

    server: RedisServer
    raw_password: ClassVar[str | None] = None

    def raw_client(self) -> Any:
        from redis.asyncio import Redis

        options: dict[str, Any] = {"password": self.raw_password} if self.raw_password else {}
        if self.server.tls is not None:
            options |= {"ssl": True, "ssl_ca_certs": self.server.tls.ca_file}
        return Redis(host="127.0.0.1", port=self.server.port, **options)


class TestRedisSingle(_OneServerSuite):
    @pytest.fixture(autouse=True)
    def _server(self, single_server: RedisServer) -> None:
        self.server = single_server
        self.url = single_server.url()

    @pytest.mark.asyncio
    async def test_the_limit_is_the_servers_proto_max_bulk_len(
        self, backend: StorageBackend
    ) -> None:
        assert backend.capabilities.max_object_bytes == MAX_BULK
        assert (await backend.stats())["max_object_bytes"] == MAX_BULK
        too_big = bytes(MAX_BULK + 1)
        assert await backend.put(["over"], [too_big]) == [False]
        assert await backend.put_missing(["over"], [too_big]) == [False]
        assert (await backend.stats())["put_too_large"] == 2


class TestRedisAuth(_OneServerSuite):
    """The ACL user: no CONFIG (``-@dangerous``), so the limit is the 512 MiB default."""

    raw_password = DEFAULT_PASSWORD

    @pytest.fixture(autouse=True)
    def _server(self, auth_server: RedisServer) -> None:
        self.server = auth_server
        self.url = auth_server.url(user=ACL_USER, password=ACL_PASSWORD)


class TestRedisTls(_OneServerSuite):
    @pytest.fixture(autouse=True)
    def _server(self, tls_server: RedisServer) -> None:
        self.server = tls_server
        self.url = tls_server.url()


class TestRedisCluster(_RedisSuite):
    @pytest.fixture(autouse=True)
    def _server(self, cluster: RedisCluster) -> None:
        self.cluster = cluster
        self.url = cluster.url()

    def raw_client(self) -> Any:
        from redis.asyncio.cluster import RedisCluster as Client

        return Client(host="127.0.0.1", port=self.cluster.nodes[1].port)
