"""RESP2 on a plain socket: commands written from the caller's segments, replies read into them.

redis-py reads a reply into an asyncio ``StreamReader`` buffer, copies it out with
``readexactly`` and hands over a new ``bytes``, which the backend copied into the caller's
buffer: three copies of every page, and the reader's buffer regrown (fresh pages) for every
large reply. Here a value is received straight into the caller's segments (``recv_into``); only
what arrived with the reply's header line passes through a small spill buffer first
(:attr:`ReplyReader.staged`). A SET sends the page's segments as they are, several to a
``sendmsg``, never joined.

Only what the direct path needs is parsed: simple strings, errors, integers, bulk strings (into
segments, or as ``bytes`` when small) and null replies. Anything else is a protocol error: the
connection is dropped.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from redis.exceptions import InvalidResponse, ResponseError

__all__ = [
    "MAX_LINE",
    "ReplyReader",
    "command",
    "send_all",
    "store_frame",
]

CRLF = b"\r\n"
# The longest header or error line taken: a longer one means the stream is not RESP.
MAX_LINE = 64 << 10
_SPILL = 256 << 10  # the reader's own buffer: header lines and the start of each value
_IOV_MAX = 512  # pieces per sendmsg (Linux allows 1024)


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def command(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(map(_bulk, args))


def store_frame(key: bytes, nbytes: int, ttl: int, only_new: bool) -> tuple[bytes, bytes]:
    """What goes before and after a ``SET key VALUE [EX ttl] [NX]``'s value of ``nbytes``: the
    value itself is sent from the caller's segments in between."""
    rest = ([b"EX", b"%d" % ttl] if ttl else []) + ([b"NX"] if only_new else [])
    head = b"*%d\r\n" % (3 + len(rest)) + _bulk(b"SET") + _bulk(key) + b"$%d\r\n" % nbytes
    return head, CRLF + b"".join(map(_bulk, rest))


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, wake)
    try:
        await ready
    finally:
        loop.remove_writer(fd)


async def send_all(sock: socket.socket, pieces: Sequence[bytes | memoryview]) -> None:
    """Send ``pieces`` in order, many to a ``sendmsg``, waiting while the socket is full.
    Cancelled, it stops at once: nothing touches the pieces after it returns."""
    loop = asyncio.get_running_loop()
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    i = 0
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i : i + _IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)
            continue
        while sent:
            n = views[i].nbytes
            if sent < n:
                views[i] = views[i][sent:]
                break
            sent -= n
            i += 1


class ReplyReader:
    """Replies from one socket, read in order. :attr:`staged` counts the value bytes that
    passed through the spill buffer on their way to a caller's segments."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_SPILL)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.staged = 0

    async def _recv_into(self, view: memoryview) -> int:
        n = await asyncio.get_running_loop().sock_recv_into(self._sock, view)
        if n == 0:
            raise ConnectionResetError("the server closed the connection")
        return n

    async def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep the unread tail, at the front
            kept = self._end - self._start
            self._buf[:kept] = self._buf[self._start : self._end]
            self._start, self._end = 0, kept
        self._end += await self._recv_into(self._view[self._end :])

    async def _line(self) -> bytes:
        while True:
            at = self._buf.find(CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise InvalidResponse("a reply line longer than 64 KiB: not a RESP server")
            await self._fill()

    async def reply(self) -> object:
        """The next reply: ``bytes`` (a simple or bulk string of at most :data:`MAX_LINE`),
        ``int``, ``None`` (null) or a ``ResponseError`` (an error reply, returned, not
        raised)."""
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ResponseError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return _number(rest)
        if kind == b"$":
            n = _number(rest)
            if n < 0:
                return None
            if n > MAX_LINE:  # the direct path asks nothing with a long answer but GET
                raise InvalidResponse(f"a {n}-byte reply where a short one was due")
            value = bytearray(n)
            await self._take(memoryview(value), n)  # a small reply of its own: not staged
            await self._crlf()
            return bytes(value)
        raise InvalidResponse(f"unexpected reply type {kind!r}")

    async def value_into(self, segments: Sequence[memoryview]) -> int | ResponseError | None:
        """The next reply, a bulk string, received into ``segments``: its size, ``None`` for
        a null reply or an error reply. A value larger than ``segments`` is read past, not
        copied, and its size returned (the caller sees it does not fit)."""
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ResponseError(rest.decode("utf-8", "replace"))
        if kind != b"$":
            raise InvalidResponse(f"unexpected reply type {kind!r} to GET")
        n = _number(rest)
        if n < 0:
            return None
        if n > sum(s.nbytes for s in segments):
            await self._skip(n)
        else:
            left = n
            for seg in segments:
                if not left:
                    break
                taken = min(seg.nbytes, left)
                self.staged += await self._take(seg, taken)
                left -= taken
        await self._crlf()
        return n

    async def _take(self, dest: memoryview, n: int) -> int:
        """``n`` bytes into ``dest``: what the spill buffer holds first (their count is
        returned), the rest straight from the socket."""
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        held = min(n, self._end - self._start)
        if held:
            dest[:held] = self._view[self._start : self._start + held]
            self._start += held
        spilled = held
        while held < n:
            held += await self._recv_into(dest[held:n])
        return spilled

    async def _skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                await self._fill()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step

    async def _crlf(self) -> None:
        while self._end - self._start < 2:
            await self._fill()
        if self._view[self._start : self._start + 2] != CRLF:
            raise InvalidResponse("a bulk reply not ended by CRLF")
        self._start += 2


def _number(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidResponse(f"not a number in a reply header: {text[:32]!r}") from None
