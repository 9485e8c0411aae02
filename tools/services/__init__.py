"""Local service processes that tests and benchmarks start for themselves, on 127.0.0.1 only,
each stopped by its pid: nothing is left running when its ``with`` block ends.

- :mod:`.process`: free loopback ports and :class:`ManagedProcess`, the base of the others;
- :mod:`.moto`: a moto S3 server (``fsspec`` over ``s3://``);
- :mod:`.mooncake`: a ``mooncake_master``;
- :mod:`.redis`: ``redis-server`` processes (plain, TLS, cluster, sentinels).
"""

from hicache.tools.services.mooncake import MooncakeMaster, mooncake_master, mooncake_master_path
from hicache.tools.services.moto import MotoServer, moto_server
from hicache.tools.services.process import LOOPBACK, ManagedProcess, free_port, wait_for_port
from hicache.tools.services.redis import (
    RedisCluster,
    RedisSentinels,
    RedisServer,
    RedisTls,
    redis_cluster,
    redis_executable,
    redis_sentinels,
)

__all__ = [
    "LOOPBACK",
    "ManagedProcess",
    "MooncakeMaster",
    "MotoServer",
    "RedisCluster",
    "RedisSentinels",
    "RedisServer",
    "RedisTls",
    "free_port",
    "mooncake_master",
    "mooncake_master_path",
    "moto_server",
    "redis_cluster",
    "redis_executable",
    "redis_sentinels",
    "wait_for_port",
]
