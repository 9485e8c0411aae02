"""Real ``redis-server`` processes on 127.0.0.1 for tests and benchmarks, stopped by pid.

A :class:`RedisServer` is one server on a free port, in a directory of its own, with nothing
saved (``--save '' --appendonly no``): plain, with a password and ACL users, with TLS, or a node
of a cluster. Its port stays fixed for the object's life, so :meth:`RedisServer.restart` brings
it back on the same address (empty), which is how reconnection is tested. :func:`redis_cluster`
starts masters and joins them with ``redis-cli --cluster create``; :func:`redis_sentinels`, a
master, a replica and a sentinel that watches them.

The servers come from Debian's ``redis-server`` package (``apt-get install redis-server``, which
also gives ``redis-cli``); one the package may have started as a service is never used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from hicache.errors import BackendUnavailableError
from hicache.tools.services.process import LOOPBACK, ManagedProcess, free_port

__all__ = [
    "RedisCluster",
    "RedisSentinels",
    "RedisServer",
    "RedisTls",
    "redis_cluster",
    "redis_executable",
    "redis_sentinels",
]


def redis_executable(name: str = "redis-server") -> str:
    """``redis-server`` or ``redis-cli`` on PATH; a typed error says how to install it."""
    exe = shutil.which(name)
    if not exe:
        raise BackendUnavailableError(f"{name} not found: apt-get install redis-server")
    return exe


@dataclass(frozen=True, slots=True)
class RedisTls:
    """The server's certificate and key, and the CA that signed it (a self-signed one is its
    own CA)."""

    cert_file: str
    key_file: str
    ca_file: str


class RedisServer(ManagedProcess):
    """One ``redis-server`` on a free loopback port; start, stop, kill (a crash) and restart it
    (on the same port, empty)."""

    def __init__(
        self,
        directory: str,
        args: Sequence[str] = (),
        tls: RedisTls | None = None,
        password: str | None = None,
    ) -> None:
        self.directory = directory
        self.port = free_port()
        self.tls = tls
        self.password = password  # the default user's (requirepass), for redis-cli
        extra = [*args, *(["--requirepass", password] if password is not None else [])]
        log = os.path.join(directory, f"redis-{self.port}.log")
        super().__init__(self._argv(extra), self.port, log)

    def _argv(self, extra: list[str]) -> list[str]:
        argv = [redis_executable(), "--bind", LOOPBACK, "--dir", self.directory]
        argv += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        if self.tls is None:
            argv += ["--port", str(self.port)]
        else:
            t = self.tls
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            argv += ["--tls-cert-file", t.cert_file, "--tls-key-file", t.key_file]
            argv += ["--tls-ca-cert-file", t.ca_file]
        return argv + extra

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def url(
        self, *, user: str | None = None, password: str | None = None, **options: object
    ) -> str:
        """A URL for this server: ``rediss://`` with TLS; ``options`` are backend options."""
        scheme = "rediss" if self.tls is not None else "redis"
        auth = ""
        if password is not None:
            auth = f"{quote(user or '', safe='')}:{quote(password, safe='')}@"
        if self.tls is not None:
            options.setdefault("ca_file", self.tls.ca_file)
        query = urlencode({k: str(v) for k, v in options.items()}, safe=":/,")
        return f"{scheme}://{auth}{self.address}" + (f"?{query}" if query else "")

    def cli(self, *args: str, timeout_s: float = 30.0) -> str:
        """``redis-cli`` against this server (as the default user); its output."""
        argv = [redis_executable("redis-cli"), "-h", LOOPBACK, "-p", str(self.port)]
        if self.tls is not None:
            argv += ["--tls", "--cacert", self.tls.ca_file]
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password  # not on the command line
        done = subprocess.run(
            [*argv, *args], capture_output=True, text=True, env=env, timeout=timeout_s
        )
        if done.returncode != 0:
            raise BackendUnavailableError(f"redis-cli {args[:1]} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def restart(self, timeout_s: float = 30.0) -> None:
        self.stop()
        self.start(timeout_s)

    def __enter__(self) -> RedisServer:
        self.start()
        return self


@dataclass(frozen=True, slots=True)
class RedisCluster:
    """Masters joined into one cluster; any of them is an entry point."""

    nodes: list[RedisServer]

    def url(self, **options: Any) -> str:
        return self.nodes[0].url(cluster="true", **options)


@contextlib.contextmanager
def redis_cluster(
    directory: str, masters: int = 3, args: Sequence[str] = (), timeout_s: float = 30.0
) -> Iterator[RedisCluster]:
    """``masters`` cluster-enabled servers, all slots assigned, no replicas; stopped after."""
    os.makedirs(directory, exist_ok=True)
    nodes: list[RedisServer] = []
    try:
        for _ in range(masters):
            # The bus port is named: the default (port + 10000) may be taken or out of range.
            bus = free_port()
            own = ["--cluster-enabled", "yes", "--cluster-port", str(bus)]
            own += ["--cluster-config-file", f"nodes-{bus}.conf"]
            node = RedisServer(directory, [*args, *own])
            node.start(timeout_s)
            nodes.append(node)
        create = ["--cluster", "create", *(n.address for n in nodes)]
        nodes[0].cli(*create, "--cluster-replicas", "0", "--cluster-yes", timeout_s=timeout_s)
        _wait_for_cluster(nodes, timeout_s)
        yield RedisCluster(nodes)
    finally:
        for node in nodes:
            node.stop()


def _wait_for_cluster(nodes: list[RedisServer], timeout_s: float) -> None:
    """Until every node says the cluster is ok (it does once the gossip has met everyone)."""
    _wait_until(
        lambda: all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes), timeout_s
    )


@dataclass(frozen=True, slots=True)
class RedisSentinels:
    """A master, its replica and a sentinel watching them as ``service``."""

    master: RedisServer
    replica: RedisServer
    sentinel: RedisServer
    service: str

    def url(self, **options: Any) -> str:
        """A ``redis://`` URL naming the sentinel and the service, no host."""
        query = urlencode({k: str(v) for k, v in options.items()}, safe=":/,")
        extra = f"&{query}" if query else ""
        return f"redis://?sentinel={self.sentinel.address}&service={self.service}{extra}"

    def replica_ready(self) -> bool:
        """Whether the sentinel sees a replica in sync that it could promote."""
        fields = self.sentinel.cli("SENTINEL", "REPLICAS", self.service).split("\n")
        info = dict(zip(fields[::2], fields[1::2], strict=False))
        return info.get("flags") == "slave" and info.get("master-link-status") == "ok"

    def master_port(self) -> int:
        """The port of the server the sentinel names master now."""
        answer = self.sentinel.cli("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(answer.split()[1])


@contextlib.contextmanager
def redis_sentinels(
    directory: str,
    service: str = "hicache",
    timeout_s: float = 30.0,
    sentinel_password: str | None = None,
) -> Iterator[RedisSentinels]:
    """A master, a replica of it and one sentinel (quorum 1), each started and stopped here;
    with ``sentinel_password``, the sentinel asks its clients for it."""
    started: list[RedisServer] = []
    try:
        # The replica's first sync starts at once, not after the default 5 s wait.
        master = RedisServer(directory, ["--repl-diskless-sync-delay", "0"])
        master.start(timeout_s)
        started.append(master)
        replica = RedisServer(directory, ["--replicaof", LOOPBACK, str(master.port)])
        replica.start(timeout_s)
        started.append(replica)
        sentinel = RedisServer(directory, password=sentinel_password)
        # A sentinel reads (and rewrites) a config file of its own: its command line is that.
        conf = os.path.join(directory, f"sentinel-{sentinel.port}.conf")
        with open(conf, "w", encoding="ascii") as f:
            f.write(f"sentinel monitor {service} {LOOPBACK} {master.port} 1\n")
            f.write(f"sentinel down-after-milliseconds {service} 1000\n")
            f.write(f"sentinel failover-timeout {service} 5000\n")
            if sentinel_password is not None:
                f.write(f"requirepass {sentinel_password}\n")
        argv = [redis_executable(), conf, "--sentinel", "--bind", LOOPBACK]
        sentinel.argv = [*argv, "--port", str(sentinel.port), "--dir", directory]
        sentinel.start(timeout_s)
        started.append(sentinel)
        found = RedisSentinels(master, replica, sentinel, service)
        # Ready once the sentinel sees the replica in sync: a failover asked for earlier finds
        # no replica it may promote and is dropped.
        _wait_until(found.replica_ready, timeout_s)
        yield found
    finally:
        for server in reversed(started):
            server.stop()


def _wait_until(ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise BackendUnavailableError(f"redis did not get ready within {timeout_s} s")
        time.sleep(0.05)
