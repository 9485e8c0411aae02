"""Where ``hicache bench lmcache``'s two sides store: the configuration fields of each side and
LMCache's name for the tier each builds, over a disk, a ``redis-server`` or a Redis Cluster.

Disk: ours is the hicache plugin over ``disk://DIR/hicache``, theirs LMCache's
``LocalDiskBackend`` in ``DIR/lmcache`` with room for every round. Redis: a ``redis-server``
the run starts (nothing saved, no memory limit); ours is the plugin over ``redis://`` (under a
key prefix), theirs LMCache's own ``redis`` remote-storage plugin (its ``RedisConnector``).
Redis Cluster: three masters the run starts; ours is the plugin over ``redis://...?cluster=true``,
theirs LMCache's ``redis-cluster://`` connector (``RedisClusterConnector``, set as the legacy
``remote_url``: its adapter takes no plugin form). Both Redis kinds are emptied after each
side's round (untimed), so they hold one round's chunks at most.

Emptied key by key (``DEL``), not with ``FLUSHALL``: Redis 7 hands a flushed database's memory
back to the system (a jemalloc purge), so each byte the next round stored or sent landed on a
page faulted in anew. 32 MiB of 512 KiB ``SET``s after a ``FLUSHALL`` took 8,300 page faults
and 30-37 ms; after a ``DEL`` of the previous 32 MiB, 30-190 faults and 11-12 ms (redis-py,
four rounds each). A cache server in service reuses what it evicted or deleted; the runs
before this change measured both sides against a server faulting every page.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["OURS", "THEIRS", "Store", "disk_store", "drain_redis_connector", "redis_store"]

OURS, THEIRS = "hicache", "lmcache"
_OUR_TIER = "RemoteBackend-hicache"  # LMCache's name for the plugin's backend


@dataclass(frozen=True, slots=True)
class Store:
    """Each side's configuration fields and LMCache's name for the tier they build, whether
    the page-cache floors run, and what runs after each side's round (untimed)."""

    root: str
    fields: dict[str, dict[str, Any]]
    tiers: dict[str, str]
    floors: bool
    after_round: Callable[[], None]


def plugin_fields(url: str) -> dict[str, Any]:
    """The hicache plugin as the README configures it."""
    return {
        "remote_serde": "naive",
        "remote_storage_plugins": ["hicache"],
        "extra_config": {
            "remote_storage_plugin.hicache.module_path": "hicache.integrations.lmcache",
            "remote_storage_plugin.hicache.class_name": "LMCacheConnectorAdapter",
            "remote_storage_plugin.hicache.url": url,
        },
    }


def disk_store(root: str, round_bytes: int, rounds: int) -> Store:
    """LMCache's local disk tier with room for every round's chunks: no put evicts."""
    theirs = {
        "local_disk": os.path.join(root, THEIRS),
        "max_local_disk_size": 1.1 * rounds * round_bytes / 2**30,
    }
    fields = {OURS: plugin_fields(f"disk://{os.path.join(root, OURS)}"), THEIRS: theirs}
    tiers = {OURS: _OUR_TIER, THEIRS: "LocalDiskBackend"}
    return Store(root, fields, tiers, True, lambda: None)


@contextlib.contextmanager
def redis_store(root: str, cluster: bool) -> Iterator[Store]:
    """A ``redis-server`` (or a 3-master cluster) for the run, and both sides over it."""
    from hicache.tools.services.redis import RedisServer, redis_cluster

    with contextlib.ExitStack() as stack:
        if cluster:
            nodes = stack.enter_context(redis_cluster(os.path.join(root, "cluster"))).nodes
            ours = nodes[0].url(cluster="true", key_prefix="hicache/")
            addresses = ",".join(node.address for node in nodes)
            theirs: dict[str, Any] = {
                "remote_serde": "naive",
                "remote_url": f"redis-cluster://{addresses}",
            }
            tier = "RemoteBackend"
        else:
            nodes = [stack.enter_context(RedisServer(root))]
            ours = nodes[0].url(key_prefix="hicache/")
            extra = {"remote_storage_plugin.redis.redis_url": nodes[0].url()}
            theirs = {"remote_serde": "naive", "remote_storage_plugins": ["redis"]}
            theirs["extra_config"] = extra
            tier = "RemoteBackend-redis"

        def empty() -> None:
            for node in nodes:
                _delete_every_key(node.port)

        fields = {OURS: plugin_fields(ours), THEIRS: theirs}
        yield Store(root, fields, {OURS: _OUR_TIER, THEIRS: tier}, False, empty)


def _delete_every_key(port: int) -> None:
    """``DEL`` of each key the server on ``port`` holds (a cluster master: the keys of its own
    slots, each deleted on it), keeping its memory for the next round's values."""
    import redis

    from hicache.tools.services.process import LOOPBACK

    with redis.Redis(host=LOOPBACK, port=port) as client:
        keys = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(key)
        pipe.execute()


def drain_redis_connector(backend: Any) -> None:
    """Stop an LMCache Redis connector's job queue from outside its loop, then make its own
    stop a no-op: its ``close`` (run on that loop) waits on the loop for the queue to stop and
    so never returns (LMCache 0.5.6, ``RedisConnector`` and ``RedisClusterConnector``)."""
    connector = getattr(backend.connection, "_connector", backend.connection)
    executor = getattr(connector, "pq_executor", None)
    if executor is None:
        return
    asyncio.run_coroutine_threadsafe(executor.shutdown_async(True), backend.loop).result(30)
    executor.shutdown = lambda wait=True: None
