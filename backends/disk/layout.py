"""The ``disk`` store's directory: its marker file, its three folders, its writer slots.

::

    DIR/hicache-disk.json     format name, version and segment size (written once)
    DIR/segments/             wNNN-XXXXXXXX.seg: records appended by slot NNN
    DIR/index/                wNNN.GGGGGGGG.log (each slot's log), snapshot, snapshot.lock
    DIR/locks/                wNNN.lock: held (flock) by the process writing as slot NNN

The root is resolved once; every name below it is opened relative to a directory descriptor
with ``O_NOFOLLOW``, so a link planted inside the store is never followed out of it. A writer
takes the lowest free slot; a process killed with ``kill -9`` releases its lock with its life,
and the next writer to take the slot carries its log on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
from dataclasses import dataclass

from hicache.backends._open_flags import NOFOLLOW
from hicache.backends.disk.config import DEFAULT_SEGMENT_BYTES, DiskConfig
from hicache.backends.disk.format import FORMAT_VERSION
from hicache.errors import BackendUnavailableError, ConfigError

__all__ = ["StoreDirs", "claim_slot", "open_store_dirs", "try_lock_slot"]

MARKER = "hicache-disk.json"
_FORMAT = "hicache-disk"
_SUBDIRS = ("segments", "index", "locks")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class StoreDirs:
    root: str  # resolved
    root_fd: int
    segments: int
    index: int
    locks: int
    segment_bytes: int

    def close(self) -> None:
        for fd in (self.segments, self.index, self.locks, self.root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def open_store_dirs(config: DiskConfig) -> StoreDirs:
    """Open (a writer: create) the store at ``config.root``; a clear error for anything else."""
    root = os.path.realpath(config.root)
    if not config.read_only:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise _unusable(config.root, exc.strerror or str(exc)) from None
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        what = "no such directory" if isinstance(exc, FileNotFoundError) else exc.strerror
        raise _unusable(config.root, what or str(exc)) from None
    opened: list[int] = [root_fd]
    try:
        segment_bytes = _marker(root_fd, config)
        for name in _SUBDIRS:
            opened.append(_subdir(root_fd, name, config))
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    _, segments, index, locks = opened
    return StoreDirs(root, root_fd, segments, index, locks, segment_bytes)


def _marker(root_fd: int, config: DiskConfig) -> int:
    """The store's segment size, from its marker file (written first by a new store's writer)."""
    try:
        fd = os.open(MARKER, os.O_RDONLY | NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except FileNotFoundError:
        if config.read_only:
            raise BackendUnavailableError(
                f"no disk store at {config.root} (no {MARKER}); a read-only open creates nothing"
            ) from None
        return _create_marker(root_fd, config)
    except OSError as exc:
        raise _unusable(config.root, f"cannot read {MARKER}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(4096)
    except OSError as exc:  # a directory named like the marker, an I/O error
        raise _unusable(config.root, f"cannot read {MARKER}: {exc.strerror}") from None
    try:
        meta = json.loads(raw)
        fmt, version, seg = meta["format"], meta["version"], meta["segment_bytes"]
    except (ValueError, KeyError, TypeError):
        raise BackendUnavailableError(
            f"{config.root}/{MARKER} is damaged or not a hicache disk store's"
        ) from None
    if fmt != _FORMAT or not isinstance(version, int) or not isinstance(seg, int):
        raise BackendUnavailableError(f"{config.root} is not a hicache disk store ({MARKER})")
    if version > FORMAT_VERSION:
        raise BackendUnavailableError(
            f"{config.root} is a disk store of format {version}; this hicache reads format "
            f"{FORMAT_VERSION}: upgrade hicache, or use another directory"
        )
    if not 64 << 10 <= seg < 1 << 32:  # what DiskConfig allows: else every put failed quietly
        raise BackendUnavailableError(
            f"{config.root}/{MARKER} is damaged: segment_bytes={seg} is out of range"
        )
    if config.segment_bytes is not None and config.segment_bytes != seg:
        raise ConfigError(
            f"{config.root} was created with segment_bytes={seg}, not {config.segment_bytes}: "
            "leave segment_bytes out to use the store's"
        )
    return seg


def _create_marker(root_fd: int, config: DiskConfig) -> int:
    stray = [n for n in os.listdir(root_fd) if n not in _SUBDIRS and not n.startswith(".")]
    if stray:
        raise BackendUnavailableError(
            f"{config.root} is not empty and holds no {MARKER}: not a disk store (for a "
            f"file:// store use file://; else pick an empty or new directory). Found: {stray[0]}"
        )
    seg = config.segment_bytes or DEFAULT_SEGMENT_BYTES
    body = json.dumps({"format": _FORMAT, "version": FORMAT_VERSION, "segment_bytes": seg})
    tmp = f".{MARKER}.{os.getpid()}.{random.getrandbits(32):08x}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644, dir_fd=root_fd)
    try:
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        # link() never replaces: when two processes create a store at once, one marker wins.
        os.link(tmp, MARKER, src_dir_fd=root_fd, dst_dir_fd=root_fd, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp, dir_fd=root_fd)
    return _marker(root_fd, config)


def _subdir(root_fd: int, name: str, config: DiskConfig) -> int:
    if not config.read_only:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=root_fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError as exc:
        raise _unusable(config.root, f"{name}/: {exc.strerror}") from None


def try_lock_slot(locks_fd: int, slot: int) -> int | None:
    """Slot ``slot``'s lock file, locked by this process; None when another holds it."""
    flags = os.O_RDWR | os.O_CREAT | NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(f"w{slot:03d}.lock", flags, 0o600, dir_fd=locks_fd)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def claim_slot(dirs: StoreDirs, max_writers: int) -> tuple[int, int]:
    """The lowest free writer slot and its locked file."""
    for slot in range(max_writers):
        fd = try_lock_slot(dirs.locks, slot)
        if fd is not None:
            return slot, fd
    raise BackendUnavailableError(
        f"{dirs.root}: all {max_writers} writer slots are held by running processes; raise "
        "max_writers or open read_only=true"
    )


def _unusable(root: str, why: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"disk store root {root} is unusable ({why}): point it at a directory this process "
        "can create and write"
    )
