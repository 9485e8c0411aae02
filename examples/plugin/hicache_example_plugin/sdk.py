"""A stand-in for a vendor's blocking client library: the kind of SDK a backend often wraps.

:class:`BlockingKVClient` has the shape of many storage SDKs: synchronous calls that each wait
for a server (here, ``time.sleep(latency_s)`` plays the network), safe to call from several
threads at once. Its "servers" are dicts in this process, one per endpoint name, so two clients
of one endpoint see the same objects, as two clients of one server would.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

__all__ = ["BlockingKVClient", "StoredObject"]


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object as the server lists it."""

    key: str
    size: int
    mtime: float


@dataclass
class _Server:
    lock: threading.Lock = field(default_factory=threading.Lock)
    objects: dict[str, tuple[bytes, float]] = field(default_factory=dict)


_SERVERS: dict[str, _Server] = {}
_SERVERS_LOCK = threading.Lock()


class BlockingKVClient:
    """A synchronous key-value client: every method blocks until the server answers."""

    def __init__(self, endpoint: str, latency_s: float = 0.0) -> None:
        with _SERVERS_LOCK:
            self._server = _SERVERS.setdefault(endpoint, _Server())
        self.endpoint = endpoint
        self.latency_s = latency_s

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing what was there; whole or not at all."""
        self._wait()
        with self._server.lock:
            self._server.objects[key] = (bytes(data), time.time())

    def get(self, key: str) -> bytes | None:
        self._wait()
        with self._server.lock:
            entry = self._server.objects.get(key)
        return None if entry is None else entry[0]

    def exists(self, key: str) -> bool:
        self._wait()
        with self._server.lock:
            return key in self._server.objects

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        self._wait()
        with self._server.lock:
            return self._server.objects.pop(key, None) is not None

    def list(self, prefix: str = "") -> list[StoredObject]:
        self._wait()
        with self._server.lock:
            items = list(self._server.objects.items())
        return [StoredObject(k, len(v), t) for k, (v, t) in items if k.startswith(prefix)]

    def close(self) -> None:
        """Nothing to release in this stand-in; a real client closes its connections here."""

    @staticmethod
    def drop_endpoint(endpoint: str) -> None:
        """Forget a server and its objects (tests use it to clean up)."""
        with _SERVERS_LOCK:
            _SERVERS.pop(endpoint, None)

    def _wait(self) -> None:
        if self.latency_s > 0:
            time.sleep(self.latency_s)
