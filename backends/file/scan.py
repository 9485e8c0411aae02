"""Listing the ``file`` backend's store: objects, writers' temporary files, whole-tree reads.

Everything walks the fan-out directories through descriptors (see :mod:`.tree`): a link below
the root is skipped, never listed, read or unlinked, even one planted between a listing and
the action taken on it. Pure functions of the root path, so worker processes run them too.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from typing import TypeVar

import xxhash

from hicache.backends.base import ObjectInfo
from hicache.backends.file.io import ReadBuffer
from hicache.backends.file.maintenance import ObjectCheck, TempFile
from hicache.backends.file.tree import (
    READ_FLAGS,
    LinkRefusedError,
    is_fan_name,
    leaves,
    object_stat,
    open_dir,
    open_object,
    open_path_dir,
)
from hicache.errors import InvalidKeyError
from hicache.keys import validate_key

__all__ = [
    "read_groups",
    "read_tree",
    "remove_if_stale",
    "root_temp_files",
    "scan_top",
    "temp_files_in",
    "temp_files_under",
    "top_dirs",
]

# What a writer names its temporary file: ".<key>.<pid>.<48 random bits>.tmp" (see backend.py).
_TEMP_RE = re.compile(r"\..+\.[0-9]+\.[0-9a-f]{12}\.tmp\Z")
T = TypeVar("T")


def _in_root(root: str, fn: Callable[[int], list[T]]) -> list[T]:
    """``fn`` of the open root directory (closed after); nothing when there is no root."""
    try:
        fd = open_path_dir(root)
    except FileNotFoundError:
        return []
    try:
        return fn(fd)
    finally:
        os.close(fd)


def top_dirs(root: str) -> list[str]:
    """The store's first-level fan-out directories (links skipped)."""

    def fan_dirs(fd: int) -> list[str]:
        with os.scandir(fd) as it:
            return [e.name for e in it if is_fan_name(e.name) and e.is_dir(follow_symlinks=False)]

    return _in_root(root, fan_dirs)


def _object_info(entry: os.DirEntry[str], fan: str) -> ObjectInfo | None:
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


def scan_top(root: str, top: str, prefix: str) -> list[ObjectInfo]:
    """Every object under ``root/top`` whose key starts with ``prefix``."""
    out: list[ObjectInfo] = []
    for sub, leaf in leaves(root, top):
        with os.scandir(leaf) as it:
            for entry in it:
                name = entry.name
                if name[0] != "." and name.startswith(prefix):
                    info = _object_info(entry, top + sub)
                    if info is not None:
                        out.append(info)
    return out


def temp_files_in(directory: int, relative: str) -> list[TempFile]:
    """Writers' temporary files directly in the open ``directory``, named ``relative/name``."""
    now = time.time()
    out: list[TempFile] = []
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
    return out


def temp_files_under(root: str, top: str) -> list[TempFile]:
    """Temporary files in the fan-out directories below ``root/top``."""
    return [t for sub, leaf in leaves(root, top) for t in temp_files_in(leaf, f"{top}/{sub}")]


def remove_if_stale(root: str, relative: str, min_age_s: float) -> bool:
    """Unlink the temporary file ``root/relative`` unless it was written in the last
    ``min_age_s`` seconds; whether it was removed.

    The path is walked again without following links (it was listed earlier, and a directory
    may have become a link since), and the age is read again right here, so a file a slow
    writer touched since it was listed is kept. A writer stalled for longer than the grace
    period loses its file: its rename then fails and its put returns False, which costs a
    cache miss, never a torn object.
    """
    *dirs, name = relative.split("/")
    if _TEMP_RE.match(name) is None or not all(map(is_fan_name, dirs)):
        return False
    try:
        fd = open_path_dir(root)
        try:
            for part in dirs:
                inner = open_dir(part, fd)
                os.close(fd)
                fd = inner
            st = object_stat(fd, name)
            if st is None or not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < min_age_s:
                return False
            os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
    except (FileNotFoundError, NotADirectoryError):  # LinkRefusedError included
        return False
    return True


def _names_in(leaf: int, fan: str, prefix: str) -> list[str]:
    """The object files of one open fan-out directory whose names start with ``prefix``.

    The same filter as the backend's ``scan`` (see :func:`_object_info`), without a ``stat``:
    hidden and temporary files, non-files and names that do not belong here are skipped.
    """
    with os.scandir(leaf) as it:
        entries = [e for e in it if e.name[0] != "." and e.name.startswith(prefix)]
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
    root: str, tops: list[str], prefix: str, check: ObjectCheck[T], buf: ReadBuffer
) -> tuple[list[T], int, int]:
    """``check(name, data)`` for each object below ``root/top`` for each of ``tops``, read
    whole into ``buf``.

    Returns the results, the bytes read and the number of objects that could not be read (I/O
    errors other than the file being gone, or become a link). The check runs right after its
    read, while the bytes are in cache.
    """
    out: list[T] = []
    failed = nbytes = 0
    for top in tops:
        for sub, leaf in leaves(root, top):
            for name in _names_in(leaf, top + sub, prefix):
                try:
                    fd = open_object(leaf, name, READ_FLAGS)
                    try:
                        data = buf.read_whole(fd)
                    finally:
                        os.close(fd)
                except (FileNotFoundError, LinkRefusedError):  # gone since the listing
                    continue
                except OSError:
                    failed += 1
                    continue
                nbytes += data.nbytes
                out.append(check(name, data))
    return out, nbytes, failed


def read_groups(
    root: str, tops: list[str], prefix: str, check: ObjectCheck[T]
) -> tuple[list[T], int, int]:
    """:func:`read_tree` with a buffer of its own: what a worker process runs."""
    return read_tree(root, tops, prefix, check, ReadBuffer(1 << 20))


def root_temp_files(root: str) -> list[TempFile]:
    """Temporary files directly in the root (``open()``'s write probes)."""
    return _in_root(root, lambda fd: temp_files_in(fd, ""))
