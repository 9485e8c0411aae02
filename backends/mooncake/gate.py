"""How the ``mooncake`` backend lives through a master outage: backoff, probes, quiet logs.

While the master is down, each Mooncake call waits out an RPC timeout (about four seconds,
measured). The :class:`Gate` therefore turns calls away at once after a failure and lets one
through per backoff interval, and only after a TCP probe of the master's port succeeds. The
backoff doubles up to sixteen times its first value and resets on the first call that works.
"""

from __future__ import annotations

import logging
import socket
import time

from hicache.errors import ConfigError

__all__ = ["Gate", "RateLimitedLog", "local_address", "reachable"]

_MAX_BACKOFF_FACTOR = 16


class Gate:
    """Whether to try the master now; used by one thread only (the backend's worker)."""

    def __init__(self, backoff_s: float, rebuild_after_s: float) -> None:
        self._initial = backoff_s
        self._backoff = backoff_s
        self._rebuild_after = rebuild_after_s
        self._down_since: float | None = None
        self._next_try = 0.0
        self._next_rebuild = 0.0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def may_try(self, now: float) -> bool:
        return self._down_since is None or now >= self._next_try

    def failed(self, now: float) -> None:
        if self._down_since is None:
            self._down_since = now
            self._backoff = self._initial
            self._next_rebuild = now + self._rebuild_after
        self._next_try = now + self._backoff
        self._backoff = min(self._backoff * 2, self._initial * _MAX_BACKOFF_FACTOR)

    def succeeded(self) -> None:
        self._down_since = None
        self._backoff = self._initial

    def should_rebuild(self, now: float) -> bool:
        """Down for ``rebuild_after_s`` although the master answers: the client may be stale."""
        return self._down_since is not None and now >= self._next_rebuild

    def rebuilt(self, now: float) -> None:
        self._next_rebuild = now + max(self._rebuild_after, self._backoff)


class RateLimitedLog:
    """At most one warning per kind per interval, with a count of those held back."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger = logger
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        suffix = f" ({held} more since the last such warning)" if held else ""
        self._logger.warning(message + suffix, *args)


def reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def local_address(master_host: str, master_port: int) -> str:
    """This host's address on the route to the master (loopback for a local master)."""
    if master_host in ("localhost", "::1") or master_host.startswith("127."):
        return "127.0.0.1"
    try:
        # A UDP "connect" sends nothing; it only picks the route and so the local address.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((master_host, master_port))
            return str(sock.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"cannot tell this host's address toward the master {master_host} ({exc}); "
            "set local_hostname=ADDRESS in the mooncake URL"
        ) from exc
