"""The ``file`` backend's directory tree, walked without following links.

The root is the operator's choice and may be reached through links: the backend resolves it
with ``realpath`` once, at open. Below it nothing is followed. Where the kernel has
``openat2`` (Linux 5.6 and later), a key's directory or object is opened in one call with
``RESOLVE_NO_SYMLINKS``: the kernel refuses a link anywhere on the path. Elsewhere the path is
walked one component at a time: each fan-out directory is opened relative to its parent's
descriptor with ``O_DIRECTORY | O_NOFOLLOW``, the object relative to its directory's with
``O_NOFOLLOW``. Objects and temporary files are renamed, unlinked, created and stat-ed relative
to their directory's descriptor (``renameat``, ``unlinkat``, ``openat`` with ``O_EXCL``,
``fstatat`` through ``dir_fd=``). A link anywhere below the root raises
:class:`LinkRefusedError`, so whoever can write inside the store cannot point a read, a write
or an unlink at a file outside it. Descriptors live for one operation, never longer: nothing
is cached that a concurrent ``rm -r`` or ``close()`` could leave stale.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from hicache.backends._open_flags import CLOEXEC, NOFOLLOW

__all__ = [
    "DIR_FLAGS",
    "READ_FLAGS",
    "LinkRefusedError",
    "fan_of",
    "is_fan_name",
    "leaves",
    "make_leaf",
    "object_stat",
    "open_dir",
    "open_key",
    "open_leaf",
    "open_object",
    "open_path_dir",
    "unlink_object",
    "unlink_quietly_at",
    "use_openat2",
]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC
READ_FLAGS = os.O_RDONLY | NOFOLLOW | CLOEXEC
_HEX = frozenset("0123456789abcdef")
# What opening a link with O_NOFOLLOW answers: ELOOP, or ENOTDIR along with O_DIRECTORY.
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR)
_SKIP = (FileNotFoundError, NotADirectoryError)  # LinkRefusedError is one of these


class LinkRefusedError(NotADirectoryError):
    """A component below the store's root is a symbolic link; it was not followed.

    A ``NotADirectoryError`` (hence an ``OSError``): code that treats a missing or foreign
    directory as absent treats a link the same way; the backend counts it apart.
    """

    def __init__(self, name: str) -> None:
        super().__init__(errno.ELOOP, "symbolic link below the store root refused", name)

    def __reduce__(self) -> tuple[type[LinkRefusedError], tuple[str]]:
        return type(self), (self.filename,)


def fan_of(key: str) -> str:
    """The four hex digits that name ``key``'s directories: ``root/ab/cd`` for ``abcd``."""
    return xxhash.xxh3_64_hexdigest(key.encode())[:4]


def is_fan_name(name: str) -> bool:
    return len(name) == 2 and _HEX.issuperset(name)


def _raise_if_link(name: str, parent: int | None) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise LinkRefusedError(name) from None


def open_dir(name: str, parent: int) -> int:
    """The directory ``name`` of ``parent``, opened; a link there is refused."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            _raise_if_link(name, parent)
        raise


def open_path_dir(path: str) -> int:
    """A directory by path (the root, whose own path is the operator's), its last component
    not followed: the backend resolved the root, so a link there appeared since."""
    try:
        return os.open(path, DIR_FLAGS)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            _raise_if_link(path, None)
        raise


def open_leaf(root: str, fan: str) -> int:
    """The directory ``root/ab/cd`` of fan ``abcd``, opened. FileNotFoundError when it is
    absent, LinkRefusedError when a level is a link."""
    if _openat2 is not None:
        return _open_resolved(f"{root}/{fan[:2]}/{fan[2:]}", DIR_FLAGS)
    top = open_path_dir(f"{root}/{fan[:2]}")
    try:
        return open_dir(fan[2:], top)
    finally:
        os.close(top)


def open_key(root: str, fan: str, key: str, flags: int) -> int:
    """``key``'s object ``root/ab/cd/key``, opened with ``flags`` (no ``O_CREAT``); errors as
    :func:`open_leaf`'s."""
    if _openat2 is not None:
        return _open_resolved(f"{root}/{fan[:2]}/{fan[2:]}/{key}", flags)
    leaf = open_leaf(root, fan)
    try:
        return open_object(leaf, key, flags)
    finally:
        os.close(leaf)


# ----- openat2(RESOLVE_NO_SYMLINKS): one call instead of a walk -------------------------------
class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_RESOLVE_NO_SYMLINKS = 0x04
# syscall() is variadic: every integer goes as a C long, or its upper half is undefined.
_NR_OPENAT2 = ctypes.c_long(437)  # the same number on every Linux architecture
_AT_FDCWD = ctypes.c_long(-100)
_HOW_SIZE = ctypes.c_long(ctypes.sizeof(_OpenHow))
_hows: dict[int, Any] = {}  # flags -> a reference to its open_how, built once
_openat2: Callable[..., int] | None = None  # the syscall, once use_openat2 found it works
_tried = False


def _open_resolved(path: str, flags: int) -> int:
    how = _hows.get(flags)
    if how is None:  # without O_NOFOLLOW a link last is ELOOP too, O_DIRECTORY or not
        how = _OpenHow(flags & ~NOFOLLOW, 0, _RESOLVE_NO_SYMLINKS)
        how = _hows[flags] = ctypes.byref(how)
    assert _openat2 is not None
    fd = _openat2(_NR_OPENAT2, _AT_FDCWD, os.fsencode(path), how, _HOW_SIZE)
    if fd >= 0:
        return fd
    code = ctypes.get_errno()
    if code == errno.ELOOP:  # a link somewhere on the path, the last component included
        raise LinkRefusedError(path)
    raise OSError(code, os.strerror(code), path)


def use_openat2(root: str) -> bool:
    """Open keys with ``openat2`` from now on, in this process, if this kernel has it (tried on
    ``root``, which must be a directory); whether it does. Decided once per process."""
    global _openat2, _tried
    if _tried or sys.platform != "linux":
        return _openat2 is not None
    _tried = True
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return False
    syscall.restype = ctypes.c_long
    how = ctypes.byref(_OpenHow(DIR_FLAGS, 0, _RESOLVE_NO_SYMLINKS))
    fd = syscall(_NR_OPENAT2, _AT_FDCWD, os.fsencode(root), how, _HOW_SIZE)
    if fd < 0:  # ENOSYS before Linux 5.6, EPERM under some seccomp filters
        return False
    os.close(fd)
    _openat2 = syscall
    return True


def make_leaf(root: str, fan: str, sync: bool) -> int:
    """:func:`open_leaf`, creating missing levels (and syncing their parents when ``sync``)."""
    parent = open_path_dir(root)
    try:
        for name in (fan[:2], fan[2:]):
            try:
                os.mkdir(name, 0o777, dir_fd=parent)
                if sync:  # the new entry must survive a crash with the object
                    os.fsync(parent)
            except FileExistsError:
                pass
            child = open_dir(name, parent)
            os.close(parent)
            parent = child
    except BaseException:
        os.close(parent)
        raise
    return parent


def open_object(leaf: int, name: str, flags: int, mode: int = 0o666) -> int:
    """``name`` in the directory ``leaf``, opened with ``flags`` (which hold ``O_NOFOLLOW`` or
    ``O_EXCL``: neither follows a link); a link there is refused."""
    try:
        return os.open(name, flags, mode, dir_fd=leaf)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkRefusedError(name) from None
        raise


def object_stat(leaf: int, name: str) -> os.stat_result | None:
    """The entry ``name`` of ``leaf`` as it is (None when absent); a link is refused."""
    try:
        st = os.stat(name, dir_fd=leaf, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise LinkRefusedError(name)
    return st


def unlink_object(leaf: int, name: str) -> bool:
    """Unlink ``name`` from ``leaf``; False when it was absent. A link is refused and kept:
    unlinking it would be harmless, but it is no object, and a delete reports objects."""
    if object_stat(leaf, name) is None:
        return False
    try:
        os.unlink(name, dir_fd=leaf)
    except FileNotFoundError:
        return False
    return True


def unlink_quietly_at(leaf: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=leaf)


def leaves(root: str, top: str) -> Iterator[tuple[str, int]]:
    """``(name, descriptor)`` of each second-level directory below ``root/top``; each
    descriptor is closed when the caller asks for the next one. Links and vanished entries are
    skipped."""
    try:
        top_fd = open_path_dir(f"{root}/{top}")
    except _SKIP:
        return
    try:
        with os.scandir(top_fd) as it:
            subs = [e.name for e in it if is_fan_name(e.name) and e.is_dir(follow_symlinks=False)]
        for sub in subs:
            try:
                leaf = open_dir(sub, top_fd)
            except _SKIP:
                continue
            try:
                yield sub, leaf
            finally:
                os.close(leaf)
    finally:
        os.close(top_fd)
