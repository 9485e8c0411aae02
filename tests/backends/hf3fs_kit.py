"""A stand-in for 3FS's ``hf3fs_py_usrbio`` (which cannot be installed here), over real files.

It keeps the documented API and the rules the real client enforces, so the backend's USRBIO
adapter is exercised as it would be on 3FS:

- ``register_fd(fd)`` before any I/O on ``fd``; registering twice is an error, and I/O on an
  unregistered descriptor fails at ``prepare``.
- ``iovec(buffer, id, mount, block_size, numa)`` only for a buffer announced by a symlink
  ``<mount>/3fs-virt/iovs/<id>`` that points into ``/dev/shm``; ``id`` must be a UUID.
  Slicing gives iovecs over part of it; ``.result`` and ``.userdata`` are filled on completion.
- ``ioring(mount, entries, for_read, ...)``: ``prepare`` queues an I/O (direction must match the
  ring, at most ``entries`` outstanding); ``submit``/``wait`` run the queue with real
  ``os.preadv``/``os.pwritev`` into the iovec's memory; ``wait`` hands back completions in an
  order unlike ``prepare``'s (as a real ring may), ``result`` being bytes moved or -errno.

A real ring's ``wait`` would block forever for results never prepared; this one raises instead.
``ios_done`` counts executed I/Os, so a test can tell USRBIO was used; setting ``fail_with``
to an errno makes every I/O fail with it.
"""

from __future__ import annotations

import errno
import os
import uuid
from typing import Any

__all__ = [
    "deregister_fd",
    "extract_mount_point",
    "force_fsync",
    "hardlink",
    "ioring",
    "iovec",
    "punch_hole",
    "register_fd",
    "registered_fds",
]

_registered: set[int] = set()
ios_done = 0
fail_with = 0  # when set (an errno), every I/O executed reports -fail_with: a failing daemon


def register_fd(fd: int, flags: int = 0) -> None:
    os.fstat(fd)  # OSError(EBADF) for a closed descriptor, as the real call reports
    if fd in _registered:
        raise OSError(errno.EINVAL, f"fd {fd} is already registered")
    _registered.add(fd)


def deregister_fd(fd: int) -> None:
    _registered.discard(fd)


def registered_fds() -> set[int]:
    return set(_registered)


def force_fsync(fd: int) -> int:
    os.fsync(fd)
    return 0


def extract_mount_point(path: str) -> str | None:
    """The nearest directory at or above ``path`` that has a ``3fs-virt`` directory."""
    current = os.path.abspath(path)
    while True:
        if os.path.isdir(os.path.join(current, "3fs-virt")):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def hardlink(target: str, link_name: str) -> None:
    os.link(target, link_name)


def punch_hole(fd: int, start: list[int], end: list[int], flags: int = 0) -> None:
    if len(start) != len(end):
        raise RuntimeError("size not equal")
    for lo, hi in zip(start, end, strict=True):
        os.pwrite(fd, bytes(hi - lo), lo)  # reads of a hole give zeros, as these do


class iovec:  # named as the real class
    def __init__(
        self, base: Any, id: str, hf3fs_mount_point: str, block_size: int = 0, numa: int = -1
    ) -> None:
        uuid.UUID(id)  # ValueError for a malformed id, like the real constructor
        suffix = f".b{block_size}" if block_size > 0 else ""
        link = f"{hf3fs_mount_point}/3fs-virt/iovs/{id}{suffix}"
        if not os.path.islink(link):
            raise OSError(errno.ENOENT, f"iovec {id} was not announced: no symlink {link}")
        target = os.readlink(link)
        if not target.startswith("/dev/shm/") or not os.path.exists(target):
            raise OSError(errno.EINVAL, f"{link} must point at a /dev/shm segment, not {target}")
        view = memoryview(base)
        if view.readonly or not view.c_contiguous:
            raise OSError(errno.EINVAL, "an iovec needs writable, contiguous memory")
        self._view = view.cast("B")
        self._off = 0
        self._base: iovec | None = None
        self.result = 0
        self.userdata: Any = None

    @classmethod
    def _slice_of(cls, base: iovec, start: int, stop: int) -> iovec:
        piece = cls.__new__(cls)
        piece._view = base._view[start:stop]
        piece._off = base._off + start
        piece._base = base._base or base
        piece.result = 0
        piece.userdata = None
        return piece

    def __getitem__(self, key: slice) -> iovec:
        start, stop, step = key.indices(len(self._view))
        if step != 1:
            raise ValueError("step not 1 when slicing iovec")
        return iovec._slice_of(self, start, max(start, stop))

    def __len__(self) -> int:
        return len(self._view)

    @property
    def base_off(self) -> int:
        return self._off


class ioring:  # named as the real class
    def __init__(
        self,
        hf3fs_mount_point: str,
        entries: int,
        for_read: bool = True,
        io_depth: int = 0,
        priority: int | None = None,
        timeout: int | None = None,
        numa: int = -1,
        flags: int = 0,
    ) -> None:
        if not os.path.isdir(f"{hf3fs_mount_point}/3fs-virt"):
            raise OSError(errno.EINVAL, f"{hf3fs_mount_point} is not a 3FS mount")
        if entries <= 0:
            raise OSError(errno.EINVAL, "entries must be positive")
        self._entries = entries
        self._for_read = for_read
        self._queued: list[tuple[iovec, int, int]] = []
        self._done: list[iovec] = []

    @staticmethod
    def size_for_entries(entries: int) -> int:
        return 4096 + 64 * entries

    @property
    def entries(self) -> int:
        return self._entries

    def prepare(self, iov: iovec, read: bool, fd: int, off: int, userdata: Any = None) -> ioring:
        if read != self._for_read:
            raise OSError(errno.EINVAL, "the I/O direction differs from the ring's")
        if not isinstance(iov, iovec):
            raise TypeError("prepare needs an iovec (or a slice of one)")
        if fd not in _registered:
            raise OSError(errno.EBADF, f"fd {fd} is not registered (call register_fd first)")
        if len(self._queued) + len(self._done) >= self._entries:
            raise OSError(errno.EAGAIN, "the ring is full")
        iov.userdata = userdata
        self._queued.append((iov, fd, off))
        return self

    def submit(self) -> ioring:
        global ios_done
        for iov, fd, off in self._queued:
            try:
                if fd not in _registered:
                    raise OSError(errno.EBADF, "deregistered while queued")
                if fail_with:
                    raise OSError(fail_with, "injected failure")
                move = os.preadv if self._for_read else os.pwritev
                iov.result = move(fd, [iov._view], off)
            except OSError as exc:
                iov.result = -(exc.errno or errno.EIO)
            ios_done += 1
            self._done.append(iov)
        self._queued.clear()
        return self

    def wait(
        self, *, max_results: int = 0, min_results: int = 0, timeout: Any = None
    ) -> list[iovec]:
        if len(self._done) < min_results:
            self.submit()  # prepared I/Os may run at any time, not only at submit
        if len(self._done) < min_results:
            raise OSError(errno.EDEADLK, "waiting for I/Os that were never prepared")
        count = max(max_results, min_results) or len(self._done)
        out, self._done = self._done[:count], self._done[count:]
        out.reverse()  # completion order is not prepare order
        return out
