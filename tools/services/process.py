"""The base of the local service processes: free loopback ports and :class:`ManagedProcess`.

A :class:`ManagedProcess` is started with a command line, is ready once a TCP port accepts
connections, and is stopped by its pid (SIGTERM, then SIGKILL after a grace period). Nothing is
left running when the ``with`` block ends, whether it ended by an exception or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

from hicache.errors import BackendUnavailableError

__all__ = ["LOOPBACK", "ManagedProcess", "free_port", "wait_for_port"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Return once ``port`` accepts connections; raise if the process died or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BackendUnavailableError(
                f"service process exited with status {proc.returncode} before port {port} opened"
            )
        if port_open(port):
            return
        time.sleep(0.05)
    raise BackendUnavailableError(f"nothing listened on {LOOPBACK}:{port} within {timeout_s} s")


class ManagedProcess:
    """A child process that serves on ``ready_port``; stopped by pid, never left behind."""

    def __init__(self, argv: Sequence[str], ready_port: int, log_path: str | None = None) -> None:
        self.argv = list(argv)
        self.ready_port = ready_port
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 30.0) -> None:
        if self.running:
            return
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            # A session of its own, so a signal to the test runner's group does not reach it
            # and stopping it reaches any helper it forked.
            self._proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        try:
            wait_for_port(self.ready_port, timeout_s, self._proc)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill(self) -> None:
        """Stop at once with SIGKILL, as a crash would."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> ManagedProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
