"""Low-level file I/O of the ``file`` backend: whole-object vector reads and writes.

Pure functions over file descriptors, kept apart from the backend's bookkeeping (index, pins,
eviction) in ``backend.py`` and from the walk of its directories in ``tree.py`` and
``scan.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

from hicache.backends._open_flags import CLOEXEC
from hicache.backends.segments import segments_after

__all__ = [
    "ReadBuffer",
    "aligned",
    "fsync_dir",
    "read_into",
    "unlink_quietly",
    "write_all",
]

ALIGN = 4096  # O_DIRECT alignment that every Linux filesystem and block size accepts
_IOV_MAX = 1024  # the POSIX minimum the kernel allows per writev/preadv call on Linux
_MAX_RW = 0x7FFFF000  # the most one read moves on Linux: a read this long may not be the end


def aligned(view: memoryview) -> bool:
    if view.nbytes == 0 or view.nbytes % ALIGN:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


# One syscall moves the whole object in the common case; the loops only finish partial
# transfers (a signal, a write past 2 GiB, more than IOV_MAX segments). Extra Python per object
# is kept out of the common path: right after a 2 MiB copy it runs on cold caches.
def write_all(fd: int, segs: list[memoryview], size: int) -> None:
    done = os.writev(fd, segs) if size and len(segs) <= _IOV_MAX else 0
    while done < size:
        n = os.writev(fd, segments_after(segs, done)[:_IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def read_into(fd: int, segs: list[memoryview], size: int) -> int:
    """Read the file from offset 0 into ``segs``; bytes read, ``size`` unless it ended early.

    Reading into all of ``segs`` is safe: the kernel stops at end of file, and an O_DIRECT read
    of one aligned segment then moves whole blocks up to the aligned end of the buffer.
    """
    got = os.preadv(fd, segs, 0) if size and len(segs) <= _IOV_MAX else 0
    while got < size:
        n = os.preadv(fd, segments_after(segs, got)[:_IOV_MAX], got)
        if n <= 0:
            break
        got += n
    return got


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class ReadBuffer:
    """One worker's reusable read buffer, grown to the largest object it has met."""

    __slots__ = ("_iov", "_view")

    def __init__(self, size: int) -> None:
        self._grow(size)

    def _grow(self, size: int) -> None:
        data = bytearray(size)
        self._iov = [data]  # what preadv takes, built once: this runs per object
        self._view = memoryview(data)

    def read_whole(self, fd: int) -> memoryview:
        """The whole file, read from offset 0; valid until the next read into this buffer.

        One ``preadv`` in the common case: a read that leaves room in the buffer reached the end
        of the file, so no ``fstat`` is needed. Only a file that fills the buffer costs more.
        """
        while True:
            view = self._view
            n = os.preadv(fd, self._iov, 0)
            if n < view.nbytes and n < _MAX_RW:
                return view[:n]
            size = os.fstat(fd).st_size
            if size < view.nbytes:  # it shrank since the read: read it again, whole
                continue
            if n < view.nbytes:  # more than one read can move
                return view[: read_into(fd, [view[:size]], size)]
            self._grow(max(size + 1, 2 * view.nbytes))
