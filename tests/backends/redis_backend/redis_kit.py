"""What the ``redis://`` tests share besides their servers (those are in conftest): the
servers' credentials and limits, and helpers. A plain module, imported by name."""

from __future__ import annotations

import shutil
import time
from typing import Any

import pytest

from hicache.backends.redis import RedisBackend
from hicache.backends.registry import open_backend
from hicache.tools.services.redis import RedisCluster

SKIP_REASON = (
    "redis-server and redis-cli are not installed (apt-get install redis-server)"
    if not (shutil.which("redis-server") and shutil.which("redis-cli"))
    else None
)
needs_redis = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
# What the auth server takes: the default user's password, and an ACL user without
# @dangerous (so CONFIG is refused to it and the backend falls back to the default limit).
DEFAULT_PASSWORD = "default-pw-5f1c9e"
ACL_USER, ACL_PASSWORD = "alice", "alice-pw-8d27b4"
# Small enough that the conformance suite's refusal test checks the limit cheaply.
MAX_BULK = 2 << 20


def wait_cluster_ok(cluster: RedisCluster, timeout_s: float = 20.0) -> None:
    """Until every node says the cluster is ok again (a master restarted after a kill)."""
    deadline = time.monotonic() + timeout_s
    while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in cluster.nodes):
        assert time.monotonic() < deadline, "the cluster did not come back"
        time.sleep(0.05)


async def open_redis(url: str, **options: Any) -> RedisBackend:
    """The backend ``url`` opens, which must be a ``redis://`` one."""
    backend = await open_backend(url, **options)
    assert isinstance(backend, RedisBackend)
    return backend
