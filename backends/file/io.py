"""Low-level file I/O of the ``file`` backend: whole-object vector reads and writes, scanning.

Pure functions over file descriptors and directory entries, kept apart from the backend's
bookkeeping (index, pins, eviction) in ``backend.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import stat
import time
from collections.abc import Callable
from typing import TypeVar

import xxhash

from hicache.backends.base import ObjectInfo, TempFile
from hicache.errors import InvalidKeyError
from hicache.keys import validate_key

__all__ = [
    "ReadBuffer",
    "aligned",
    "fsync_dir",
    "is_fan_dir",
    "scan_top",
    "top_dirs",
    "object_info",
    "read_head",
    "read_groups",
    "read_into",
    "read_tree",
    "remove_if_stale",
    "temp_files_in",
    "temp_files_under",
    "unlink_quietly",
    "write_all",
]

ALIGN = 4096  # O_DIRECT alignment that every Linux filesystem and block size accepts
_IOV_MAX = 1024  # the POSIX minimum the kernel allows per writev/preadv call on Linux
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_HEX = frozenset("0123456789abcdef")
# What a writer names its temporary file: ".<key>.<pid>.<48 random bits>.tmp" (see backend.py).
_TEMP_RE = re.compile(r"\..+\.[0-9]+\.[0-9a-f]{12}\.tmp\Z")
_READ_FLAGS = os.O_RDONLY | _CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_MAX_RW = 0x7FFFF000  # the most one read moves on Linux: a read this long may not be the end
T = TypeVar("T")


def is_fan_dir(entry: os.DirEntry[str]) -> bool:
    name = entry.name
    return len(name) == 2 and _HEX.issuperset(name) and entry.is_dir(follow_symlinks=False)


def object_info(entry: os.DirEntry[str], fan: str) -> ObjectInfo | None:
    """The object a directory entry holds, or None for anything that is not one of ours."""
    name = entry.name
    if not xxhash.xxh3_64_hexdigest(name.encode()).startswith(fan):
        return None
    try:
        validate_key(name)
        st = entry.stat(follow_symlinks=False)
    except (InvalidKeyError, FileNotFoundError):
        return None
    return ObjectInfo(name, st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else None


def aligned(view: memoryview) -> bool:
    if view.nbytes == 0 or view.nbytes % ALIGN:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


def _tail(segs: list[memoryview], skip: int) -> list[memoryview]:
    """The views left once the first ``skip`` bytes of ``segs`` are done."""
    for i, seg in enumerate(segs):
        if skip < seg.nbytes:
            return [seg[skip:], *segs[i + 1 :]]
        skip -= seg.nbytes
    return []


# One syscall moves the whole object in the common case; the loops only finish partial
# transfers (a signal, a write past 2 GiB, more than IOV_MAX segments). Extra Python per object
# is kept out of the common path: right after a 2 MiB copy it runs on cold caches.
def write_all(fd: int, segs: list[memoryview], size: int) -> None:
    done = os.writev(fd, segs) if size and len(segs) <= _IOV_MAX else 0
    while done < size:
        n = os.writev(fd, _tail(segs, done)[:_IOV_MAX])
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
        n = os.preadv(fd, _tail(segs, got)[:_IOV_MAX], got)
        if n <= 0:
            break
        got += n
    return got


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def read_head(path: str, nbytes: int) -> bytes | None:
    """The first ``nbytes`` of a file (fewer when it is shorter); None when it is absent."""
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    try:
        return os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)


def temp_files_in(directory: str, relative: str) -> list[TempFile]:
    """Writers' temporary files directly in ``directory``, named ``relative/name``."""
    now = time.time()
    out: list[TempFile] = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name[0] != "." or _TEMP_RE.match(entry.name) is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # its writer published or removed it meanwhile
                    continue
                if stat.S_ISREG(st.st_mode):
                    name = f"{relative}/{entry.name}" if relative else entry.name
                    out.append(TempFile(name, st.st_size, max(now - st.st_mtime, 0.0)))
    except FileNotFoundError:
        pass
    return out


def remove_if_stale(path: str, min_age_s: float) -> bool:
    """Unlink a temporary file unless it was written in the last ``min_age_s`` seconds.

    The age is read again right here, so a file a slow writer touched since it was listed is
    kept. A writer stalled for longer than the grace period loses its file: its rename then
    fails and its put returns False, which costs a cache miss, never a torn object.
    """
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < min_age_s:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def temp_files_under(root: str, top: str) -> list[TempFile]:
    """Temporary files in the fan-out directories below ``root/top``."""
    try:
        with os.scandir(f"{root}/{top}") as it:
            subs = [e.name for e in it if is_fan_dir(e)]
    except FileNotFoundError:
        return []
    return [t for sub in subs for t in temp_files_in(f"{root}/{top}/{sub}", f"{top}/{sub}")]


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


def _names_in(directory: str, fan: str, prefix: str) -> list[str]:
    """The object files of one fan-out directory whose names start with ``prefix``.

    The same filter as the backend's ``scan`` (see :func:`object_info`), without a ``stat``:
    hidden and temporary files, non-files and names that do not belong here are skipped.
    """
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if e.name[0] != "." and e.name.startswith(prefix)]
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        name = entry.name
        if entry.is_file(follow_symlinks=False) and xxhash.xxh3_64_hexdigest(
            name.encode()
        ).startswith(fan):
            try:
                validate_key(name)
            except InvalidKeyError:
                continue
            names.append(name)
    return names


def read_tree(
    root: str,
    tops: list[str],
    prefix: str,
    check: Callable[[str, memoryview], T],
    buf: ReadBuffer,
) -> tuple[list[T], int, int]:
    """``check(name, data)`` for each object below ``root/top`` for each of ``tops``, read
    whole into ``buf``.

    Returns the results, the bytes read and the number of objects that could not be read (I/O
    errors other than the file being gone). The check runs right after its read, while the
    bytes are in cache.
    """
    out: list[T] = []
    failed = nbytes = 0
    for top in tops:
        for directory, fan in _fan_dirs(f"{root}/{top}", top):
            for name in _names_in(directory, fan, prefix):
                try:
                    fd = os.open(f"{directory}/{name}", _READ_FLAGS)
                    try:
                        data = buf.read_whole(fd)
                    finally:
                        os.close(fd)
                except FileNotFoundError:  # removed since the listing: not damage
                    continue
                except OSError:
                    failed += 1
                    continue
                nbytes += data.nbytes
                out.append(check(name, data))
    return out, nbytes, failed


def read_groups(
    root: str, tops: list[str], prefix: str, check: Callable[[str, memoryview], T]
) -> tuple[list[T], int, int]:
    """:func:`read_tree` with a buffer of its own: what a worker process runs."""
    return read_tree(root, tops, prefix, check, ReadBuffer(1 << 20))


def _fan_dirs(base: str, top: str) -> list[tuple[str, str]]:
    """The second-level directories below ``base``, with the hash prefix their objects have."""
    try:
        with os.scandir(base) as it:
            return [(f"{base}/{e.name}", top + e.name) for e in it if is_fan_dir(e)]
    except FileNotFoundError:
        return []


def top_dirs(root: str) -> list[str]:
    """The store's first-level fan-out directories."""
    try:
        with os.scandir(root) as it:
            return [e.name for e in it if is_fan_dir(e)]
    except FileNotFoundError:
        return []


def scan_top(root: str, top: str, prefix: str) -> list[ObjectInfo]:
    """Every object under ``root/top`` whose key starts with ``prefix``."""
    out: list[ObjectInfo] = []
    base = f"{root}/{top}"
    try:
        with os.scandir(base) as it:
            subs = [e.name for e in it if is_fan_dir(e)]
    except FileNotFoundError:
        return out
    for sub in subs:
        try:
            with os.scandir(f"{base}/{sub}") as it:
                for entry in it:
                    name = entry.name
                    if name[0] != "." and name.startswith(prefix):
                        info = object_info(entry, top + sub)
                        if info is not None:
                            out.append(info)
        except FileNotFoundError:
            continue
    return out
