"""hicache's own connections for GET and SET batches, beside redis-py's (see :mod:`.resp`).

Used for a server and for each cluster master over plain TCP; TLS and Sentinel deployments
take redis-py's path only (a TLS socket cannot be read into a caller's buffer with
``sock_recv_into``, and a sentinel's master moves). A connection is set up the way redis-py sets
up its own (``AUTH``, ``SELECT``, ``CLIENT SETNAME hicache``), so an operator's ``CLIENT KILL``
finds it, and kept for the next batch. At most ``max_connections`` are open per server at once,
as for redis-py's pool.

A failure drops the connection. An exchange on a kept connection that fails (the server closed
it: a restart, ``CLIENT KILL``, an idle timeout) is made again, once, on a new one, as
redis-py's retry does; a new connection that fails is the batch's failure. A cancelled batch
drops its connection too (its replies are half read): nothing touches the caller's buffers once
the cancel returns.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError

from hicache.backends.redis.resp import ReplyReader, command, send_all

__all__ = ["Address", "DirectLink", "DirectPool", "handshake"]

Address = tuple[str, int]
T = TypeVar("T")
Read = Callable[[ReplyReader], Awaitable[T]]


def handshake(username: str | None, password: str | None, db: int, name: str) -> list[bytes]:
    """The commands that set a new connection up, in order."""
    out = []
    if password is not None:
        user = [username.encode()] if username else []
        out.append(command(b"AUTH", *user, password.encode()))
    if db:
        out.append(command(b"SELECT", b"%d" % db))
    out.append(command(b"CLIENT", b"SETNAME", name.encode()))
    return out


class DirectLink:
    """One plain TCP connection to a server, set up and ready for commands."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = ReplyReader(sock)

    @classmethod
    async def open(cls, address: Address, setup: list[bytes]) -> DirectLink:
        """Connect and run ``setup``; an error reply to it raises ``ConnectionError``."""
        loop = asyncio.get_running_loop()
        host, port = address
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        failure: OSError = OSError(f"no address for {host}:{port}")
        for family, kind, proto, _, where in found:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, where)
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return await cls(sock)._setup(setup)
        raise failure

    async def _setup(self, setup: list[bytes]) -> DirectLink:
        try:
            await send_all(self.sock, setup)
            for _ in setup:
                reply = await self.reader.reply()
                if isinstance(reply, ResponseError):  # its text never holds the password
                    raise RedisConnectionError(f"setting a connection up failed: {reply}")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self.sock.close()


class DirectPool:
    """Kept connections per server, at most ``limit`` open per server at once."""

    def __init__(self, setup: list[bytes], limit: int) -> None:
        self._setup = setup
        self._limit = limit
        self._idle: dict[Address, list[DirectLink]] = {}
        self._slots: dict[Address, asyncio.Semaphore] = {}

    async def run(
        self, address: Address, requests: Sequence[bytes | memoryview], read: Read[T]
    ) -> tuple[T, int]:
        """Send ``requests`` to ``address`` and ``read`` the replies: what ``read`` returns,
        and the value bytes that passed through the reader's spill buffer. Raises what the
        connection raised (``OSError``, ``RedisError``)."""
        slots = self._slots.get(address)
        if slots is None:
            slots = self._slots[address] = asyncio.Semaphore(self._limit)
        async with slots:
            for attempt in (0, 1):
                idle = self._idle.setdefault(address, [])
                kept = bool(idle) and not attempt
                link = idle.pop() if kept else await DirectLink.open(address, self._setup)
                staged = link.reader.staged
                try:
                    await send_all(link.sock, requests)
                    replies = await read(link.reader)
                except (OSError, InvalidResponse):
                    link.close()
                    if kept:  # a connection the server closed meanwhile: once more, anew
                        self._drop(address)  # the others kept went the same way, likely
                        continue
                    raise
                except BaseException:
                    link.close()
                    raise
                self._idle.setdefault(address, []).append(link)
                return replies, link.reader.staged - staged
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _drop(self, address: Address) -> None:
        for link in self._idle.pop(address, []):
            link.close()

    def close(self) -> None:
        for address in list(self._idle):
            self._drop(address)
