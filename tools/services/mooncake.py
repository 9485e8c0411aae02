"""A real ``mooncake_master`` on 127.0.0.1 for tests and benchmarks, stopped by pid.

The master serves three ports, all picked free at start: its RPC port (what clients call the
master address), the HTTP metadata server the transfer engines meet at, and the HTTP admin
(metrics) server, whose ``/get_all_keys`` lets the ``mooncake`` backend list objects. The ports
stay fixed for the object's life, so :meth:`MooncakeMaster.restart` brings a crashed master back
on the same address, which is how reconnection is tested. A restarted master starts empty.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlencode

from hicache.errors import BackendUnavailableError
from hicache.tools.services.process import LOOPBACK, ManagedProcess, free_port, wait_for_port

__all__ = ["MooncakeMaster", "mooncake_master", "mooncake_master_path"]


def mooncake_master_path() -> str:
    """The ``mooncake_master`` executable: next to this Python, else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    exe = beside if os.path.exists(beside) else shutil.which("mooncake_master")
    if not exe:
        raise BackendUnavailableError(
            "mooncake_master not found: pip install 'hicache[mooncake]' "
            "(and apt-get install libibverbs1)"
        )
    return exe


@dataclass(frozen=True, slots=True)
class _Ports:
    rpc: int
    metadata: int
    admin: int


class MooncakeMaster:
    """One master process with fixed ports; start, stop, kill (a crash) and restart it."""

    def __init__(self, lease_ttl_ms: int = 10_000, log_path: str | None = None) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.ports = _Ports(free_port(), free_port(), free_port())
        self.process = ManagedProcess(self._argv(), self.ports.rpc, log_path)

    @property
    def address(self) -> str:
        """The master's RPC address, ``host:port``, as clients name it."""
        return f"{LOOPBACK}:{self.ports.rpc}"

    @property
    def metadata_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.metadata}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.admin}"

    def url(self, **options: object) -> str:
        """A ``mooncake://`` URL for this master; ``options`` are extra backend options."""
        query = {"metadata_server": self.metadata_url, "admin_url": self.admin_url}
        query.update({k: str(v) for k, v in options.items()})
        return f"mooncake://{self.address}?{urlencode(query, safe=':/')}"

    def start(self, timeout_s: float = 30.0) -> None:
        self.process.start(timeout_s)
        # The RPC port opens first; clients also need the metadata server, tools the admin one.
        try:
            for port in (self.ports.metadata, self.ports.admin):
                wait_for_port(port, timeout_s)
        except BaseException:
            self.process.stop()
            raise

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        """SIGKILL, as a crash would; :meth:`restart` brings it back on the same ports."""
        self.process.kill()

    def restart(self, timeout_s: float = 30.0) -> None:
        self.process.stop()
        self.start(timeout_s)

    @property
    def running(self) -> bool:
        return self.process.running

    def _argv(self) -> list[str]:
        p = self.ports
        return [
            mooncake_master_path(),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={p.rpc}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={LOOPBACK}",
            f"--http_metadata_server_port={p.metadata}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={p.admin}",
            "--rpc_thread_num=4",
            "--enable_metric_reporting=false",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
        ]

    def __enter__(self) -> MooncakeMaster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def mooncake_master(
    lease_ttl_ms: int = 10_000, log_path: str | None = None
) -> Iterator[MooncakeMaster]:
    """Start a master on free loopback ports for the ``with`` block; stopped by pid after."""
    with MooncakeMaster(lease_ttl_ms, log_path) as master:
        yield master
