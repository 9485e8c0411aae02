"""A moto S3 server on 127.0.0.1 for tests and benchmarks (``fsspec`` over ``s3://``), stopped by
pid."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from hicache.errors import BackendUnavailableError
from hicache.tools.services.process import LOOPBACK, ManagedProcess, free_port

__all__ = ["MotoServer", "moto_server"]


@dataclass(frozen=True, slots=True)
class MotoServer:
    """A running moto S3 server: where it is and the credentials it accepts."""

    endpoint_url: str
    port: int
    process: ManagedProcess
    access_key: str = "testing"
    secret_key: str = "testing"
    region: str = "us-east-1"


def _moto_argv(port: int) -> list[str]:
    exe = shutil.which("moto_server") or os.path.join(
        os.path.dirname(sys.executable), "moto_server"
    )
    if not os.path.exists(exe):
        raise BackendUnavailableError("moto_server not found: pip install 'moto[server]'")
    return [exe, "-H", LOOPBACK, "-p", str(port)]


@contextlib.contextmanager
def moto_server(log_path: str | None = None) -> Iterator[MotoServer]:
    """Start a moto S3 server on a free loopback port for the ``with`` block."""
    port = free_port()
    process = ManagedProcess(_moto_argv(port), port, log_path)
    with process:
        yield MotoServer(f"http://{LOOPBACK}:{port}", port, process)
