"""``direct=true``: segment I/O with ``O_DIRECT``, around the page cache.

``O_DIRECT`` wants the memory, the file offset and the length of every transfer aligned to the
device's block, which neither the callers' buffers nor 8-byte-aligned records are. So direct
I/O goes through page-aligned staging buffers (anonymous ``mmap``), and the copies are counted
as ``bytes_staged``:

- A write covers whole blocks: the run of records is copied after the bytes already written in
  its first block (the writer keeps that partial last block, :class:`DirectTail`), padded with
  zeros to a block boundary (the segment is allocated ahead, and zeros are its unwritten end).
- A read fetches the whole blocks that hold a run of records, then the records are copied out.

What it buys: a store that is written once and read rarely does not push the serving
process's pages out of the page cache. What it costs: a copy each way and a device round trip
per read, with no read-ahead.
"""

from __future__ import annotations

import errno
import mmap
import os

from hicache.backends._open_flags import CLOEXEC, NOFOLLOW

__all__ = ["BLOCK", "DirectTail", "open_direct", "read_span"]

BLOCK = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _up(n: int) -> int:
    return (n + BLOCK - 1) & ~(BLOCK - 1)


def _staging(nbytes: int) -> memoryview:
    """A page-aligned buffer of ``nbytes`` (a multiple of BLOCK), zeroed."""
    return memoryview(mmap.mmap(-1, nbytes))


def open_direct(name: str, dir_fd: int, flags: int) -> int | None:
    """``name`` opened with ``O_DIRECT`` added to ``flags``; None where the filesystem (or the
    platform) has no direct I/O, so the caller goes on buffered."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(name, flags | _O_DIRECT | NOFOLLOW | CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # tmpfs and some FUSE filesystems refuse O_DIRECT
            return None
        raise


class DirectTail:
    """The writer's copy of the partial block at the end of the open segment."""

    def __init__(self, header: bytes) -> None:
        self.block = bytearray(BLOCK)  # block 0 starts with the segment's header
        self.block[: len(header)] = header
        self.start = 0  # file offset of that block

    def write(self, fd: int, iov: list[memoryview | bytes], offset: int, nbytes: int) -> int:
        """Write the ``nbytes`` of ``iov`` at ``offset`` (where the last write ended); the
        bytes copied through staging."""
        lo = offset & ~(BLOCK - 1)
        head = offset - lo
        assert lo == self.start, "direct writes continue where the last one ended"
        total = _up(head + nbytes)
        buf = _staging(total)
        buf[:head] = self.block[:head]
        pos = head
        for part in iov:
            view = memoryview(part).cast("B")
            buf[pos : pos + view.nbytes] = view
            pos += view.nbytes
        done = 0
        while done < total:  # a short direct write stops on a block boundary
            done += os.pwrite(fd, buf[done:total], lo + done)
        last = (offset + nbytes) & ~(BLOCK - 1)
        self.start = last
        self.block[:] = buf[last - lo : last - lo + BLOCK]
        return nbytes


def read_span(fd: int, start: int, end: int) -> tuple[memoryview, int]:
    """The bytes ``start`` to ``end`` of the file (fewer at its end), through whole blocks;
    and how many bytes were staged."""
    lo, hi = start & ~(BLOCK - 1), _up(end)
    buf = _staging(hi - lo)
    got = os.preadv(fd, [buf], lo)
    usable = max(0, min(got, end - lo) - (start - lo))
    return buf[start - lo : start - lo + usable], usable
