"""The file behind one ``shm`` segment: geometry, header, typed views and cross-process locks.

A segment is one file, ``<directory>/hicache-<name>.shm`` (tmpfs under ``/dev/shm`` by default),
mapped ``MAP_SHARED`` by every process that opens the name::

    header (256 B) | metadata arrays (index, LRU, block chains, free stacks) | data blocks

One file, so creating, attaching and unlinking a segment each act on one name. The creator
allocates every page up front (``posix_fallocate``: a full tmpfs fails at open, not with SIGBUS
mid-copy) and every opener maps with ``MAP_POPULATE``, so later copies run at memcpy speed
instead of paying a page fault per 4 KiB.

Locks, both dropped by the kernel when their holder dies, so a dead process wedges nobody:

- the index mutex is ``flock(LOCK_EX)`` on the file (plus a thread lock, since ``flock`` does
  not exclude threads sharing one file description);
- each open instance owns an "owner slot": an OFD byte-range lock on byte ``slot`` of the file,
  held until close. A reservation records its owner slot and the slot's epoch; while that lock
  is held the writer is alive, so its blocks are never reclaimed under it. This holds across PID
  namespaces and PID reuse, which ``kill(pid, 0)`` does not. Where OFD locks do not exist
  (not Linux), liveness falls back to the recorded pid.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.backends._open_flags import NOFOLLOW
from hicache.errors import BackendUnavailableError, ConfigError

__all__ = [
    "ENTRY_WORDS",
    "KEY_OFFSET",
    "EntryState",
    "Geometry",
    "Hdr",
    "SegmentFile",
    "segment_path",
]

logger = logging.getLogger(__name__)

MAGIC = b"HICSHM\x00\x01"
VERSION = 1
HEADER_BYTES = 256
KEY_SLOT_BYTES = 256  # a key is at most 250 ASCII characters
MAX_OWNERS = 1024  # processes (open instances) attached at once
_ALIGN = 64
_OFD = hasattr(fcntl, "F_OFD_SETLK")
_FLOCK_FMT = "hhqqi"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (native alignment)


class Hdr(enum.IntEnum):
    """Slots of the header, an array of 32 int64; slot 0 holds the magic bytes."""

    MAGIC = 0
    VERSION = 1
    BLOCK_BYTES = 2
    N_BLOCKS = 3
    MAX_OBJECTS = 4
    N_BUCKETS = 5
    MAX_OWNERS = 6
    DATA_OFFSET = 7
    FREE_BLOCKS = 8
    FREE_ENTRIES = 9
    LRU_HEAD = 10
    LRU_TAIL = 11
    OBJECTS = 12
    USED_BYTES = 13
    EVICTIONS = 14
    RECLAIMED = 15
    TORN_RETRIES = 16
    EPOCH = 17
    WRITING = 18
    DIRTY = 19  # 1 while a process holds the index lock: found set, its holder died mid-update


class EntryState(enum.IntEnum):
    FREE = 0
    WRITING = 1  # blocks reserved, bytes being copied; invisible to readers
    READY = 2  # published: in the hash index and the LRU list


@dataclass(frozen=True, slots=True)
class Geometry:
    """Sizes fixed when a segment is created; later openers read them from the header."""

    block_bytes: int
    n_blocks: int
    max_objects: int

    @property
    def capacity_bytes(self) -> int:
        return self.block_bytes * self.n_blocks

    @property
    def n_buckets(self) -> int:
        return 1 << max(self.max_objects - 1, 1).bit_length()


# An entry is one record, so touching it costs one or two cache lines and one page, not one
# of each per field: ENTRY_WORDS int64 fields (see shm_index), then the key bytes.
ENTRY_FIELDS = 16
ENTRY_WORDS = ENTRY_FIELDS + KEY_SLOT_BYTES // 8
KEY_OFFSET = ENTRY_FIELDS * 8

# Name, struct format, length in units of: M objects, B buckets, N blocks, O owners.
_ARRAYS: tuple[tuple[str, str, str, int], ...] = (
    ("entries", "q", "M", ENTRY_WORDS),
    ("entry_stack", "i", "M", 1),  # free entries; the top is at FREE_ENTRIES - 1
    ("buckets", "i", "B", 1),  # first entry of each hash chain, or -1
    # Per block (link, run): at an extent's first block, the next extent's first block (or -1)
    # and the extent's length in blocks.
    ("blocks", "i", "N", 2),
    ("block_stack", "i", "N", 1),  # free blocks; the top is at FREE_BLOCKS - 1
    ("owner_epoch", "q", "O", 1),
)


def _array_offsets(geo: Geometry) -> tuple[dict[str, tuple[int, str, int]], int]:
    """Each array's (offset, format, count) and the data offset."""
    units = {"M": geo.max_objects, "B": geo.n_buckets, "N": geo.n_blocks, "O": MAX_OWNERS}
    out: dict[str, tuple[int, str, int]] = {}
    offset = HEADER_BYTES
    for name, fmt, unit, per_unit in _ARRAYS:
        count = units[unit] * per_unit
        out[name] = (offset, fmt, count)
        offset += -(-count * struct.calcsize(fmt) // _ALIGN) * _ALIGN
    page = mmap.PAGESIZE
    return out, -(-offset // page) * page


def segment_path(directory: str, name: str) -> str:
    return os.path.join(directory, f"hicache-{name}.shm")


def _flock_arg(lock_type: int, offset: int) -> bytes:
    return struct.pack(_FLOCK_FMT, lock_type, os.SEEK_SET, offset, 1, 0) + bytes(8)


class SegmentFile:
    """An open, mapped segment. Arrays are attributes named as in ``_ARRAYS``.

    Each array exists twice over the same bytes: a memoryview attribute (fast scalar access,
    plain ints) and a numpy array in ``arrays`` (vectorised scans and slices). ``key_bytes``
    is the entries as bytes, for the keys inside them.
    """

    entries: memoryview
    entry_stack: memoryview
    buckets: memoryview
    blocks: memoryview
    block_stack: memoryview
    owner_epoch: memoryview

    def __init__(self, path: str, fd: int, mm: mmap.mmap, geometry: Geometry) -> None:
        self.path = path
        self.fd = fd
        self.geometry = geometry
        self.owner = -1
        self.epoch = 0
        self._mm: mmap.mmap | None = mm
        self._thread_lock = threading.Lock()
        self._views: list[memoryview] = []
        self.arrays: dict[str, np.ndarray] = {}
        offsets, data_offset = _array_offsets(geometry)
        self.header = self._view(mm, 0, "q", HEADER_BYTES // 8)
        for name, (offset, fmt, count) in offsets.items():
            setattr(self, name, self._view(mm, offset, fmt, count))
            self.arrays[name] = np.frombuffer(mm, np.dtype(fmt), count, offset)
        offset = offsets["entries"][0]
        self.key_bytes = self._view(mm, offset, "B", geometry.max_objects * ENTRY_WORDS * 8)
        self.data = np.frombuffer(mm, np.uint8, geometry.capacity_bytes, data_offset)

    def _view(self, mm: mmap.mmap, offset: int, fmt: str, count: int) -> memoryview:
        raw = memoryview(mm)[offset : offset + count * struct.calcsize(fmt)]
        fmt_any: Any = fmt  # typeshed overloads cast() on literal formats only
        view: memoryview = raw.cast(fmt_any)
        self._views += [raw, view]
        return view

    # ----- open / create ----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, want: Geometry, explicit: frozenset[str]) -> SegmentFile:
        """Attach to the segment at ``path``, creating it with ``want`` if it does not exist.

        ``explicit`` names the geometry fields the caller set on purpose: those must match an
        existing segment (:class:`ConfigError`); the others are taken from its header.
        """
        for _ in range(8):
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | NOFOLLOW
            try:
                fd = os.open(path, flags, 0o600)
            except OSError as exc:
                raise BackendUnavailableError(
                    f"cannot open shared memory segment {path}: {exc}; check that the "
                    "directory exists and is writable (set `directory` where /dev/shm is missing)"
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not _still_linked(fd, path):
                    os.close(fd)  # unlinked between our open and our lock: open the new one
                    continue
                segment = cls._open_locked(path, fd, want, explicit)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return segment
            except BaseException:
                os.close(fd)
                raise
        raise BackendUnavailableError(f"{path} kept being replaced while opening it")

    @classmethod
    def _open_locked(
        cls, path: str, fd: int, want: Geometry, explicit: frozenset[str]
    ) -> SegmentFile:
        head = os.pread(fd, HEADER_BYTES, 0)
        size = os.fstat(fd).st_size
        if size == 0 or (len(head) >= 8 and head[:8] == bytes(8)):
            # New, or its creator died before writing the magic (it held this lock): start over.
            return cls._create(path, fd, want)
        geometry = _read_geometry(path, head, size)
        for field in sorted(explicit):
            if getattr(geometry, field) != getattr(want, field):
                raise ConfigError(
                    f"shared memory segment {path} exists with {field}="
                    f"{getattr(geometry, field)}, not {getattr(want, field)}; open it without "
                    "that option to attach, or unlink it first (SharedMemoryBackend.unlink_segment)"
                )
        segment = cls(path, fd, _map(fd, geometry), geometry)
        segment._claim_owner()
        return segment

    @classmethod
    def _create(cls, path: str, fd: int, geometry: Geometry) -> SegmentFile:
        _, data_offset = _array_offsets(geometry)
        total = data_offset + geometry.capacity_bytes
        try:
            os.ftruncate(fd, 0)  # zero whatever a dead creator left
            os.ftruncate(fd, total)
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            os.unlink(path)
            raise BackendUnavailableError(
                f"cannot allocate {total} bytes for shared memory segment {path}: {exc}; lower "
                "capacity_bytes or enlarge the tmpfs (docker: --shm-size)"
            ) from exc
        segment = cls(path, fd, _map(fd, geometry), geometry)
        segment._initialise(data_offset)
        segment._claim_owner()
        logger.info("created shared memory segment %s (%d bytes)", path, total)
        return segment

    def _initialise(self, data_offset: int) -> None:
        geo, hdr, arrays = self.geometry, self.header, self.arrays
        # Stacks pop from the end: lay them out so pops yield 0, 1, 2, ... (contiguous extents).
        arrays["entry_stack"][:] = np.arange(geo.max_objects - 1, -1, -1, dtype=np.int32)
        arrays["block_stack"][:] = np.arange(geo.n_blocks - 1, -1, -1, dtype=np.int32)
        arrays["buckets"][:] = -1
        values = {
            Hdr.VERSION: VERSION,
            Hdr.BLOCK_BYTES: geo.block_bytes,
            Hdr.N_BLOCKS: geo.n_blocks,
            Hdr.MAX_OBJECTS: geo.max_objects,
            Hdr.N_BUCKETS: geo.n_buckets,
            Hdr.MAX_OWNERS: MAX_OWNERS,
            Hdr.DATA_OFFSET: data_offset,
            Hdr.FREE_BLOCKS: geo.n_blocks,
            Hdr.FREE_ENTRIES: geo.max_objects,
            Hdr.LRU_HEAD: -1,
            Hdr.LRU_TAIL: -1,
        }
        for slot, value in values.items():
            hdr[slot] = value
        hdr[Hdr.MAGIC] = struct.unpack("=q", MAGIC)[0]  # last: the segment is now valid

    # ----- locks ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[bool]:
        """Exclusive access to the index and allocator, across threads and processes.

        Yields whether the previous holder died while changing the index (the caller repairs
        it before anything else).
        """
        with self._thread_lock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                dirty = self.header[Hdr.DIRTY] != 0
                self.header[Hdr.DIRTY] = 1
                yield dirty
                self.header[Hdr.DIRTY] = 0  # not on an exception: the index may be half-changed
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _claim_owner(self) -> None:
        """Take a free owner slot (call with the file locked)."""
        if not _OFD:
            return
        for slot in range(MAX_OWNERS):
            try:
                fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _flock_arg(fcntl.F_WRLCK, slot))
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    continue
                raise
            self.header[Hdr.EPOCH] += 1
            self.owner, self.epoch = slot, self.header[Hdr.EPOCH]
            self.owner_epoch[slot] = self.epoch
            return
        raise BackendUnavailableError(f"{self.path}: {MAX_OWNERS} instances attached already")

    def writer_alive(self, owner: int, epoch: int, pid: int) -> bool:
        """Whether the instance that reserved an entry may still be copying into it."""
        if owner == self.owner and epoch == self.epoch and owner >= 0:
            return True
        if not _OFD or owner < 0:
            return _pid_alive(pid)
        if self.owner_epoch[owner] != epoch:
            return False  # the slot was claimed again, so its holder had gone
        arg = _flock_arg(fcntl.F_WRLCK, owner)
        result = fcntl.fcntl(self.fd, fcntl.F_OFD_GETLK, arg)
        return int(struct.unpack_from("h", result)[0]) != fcntl.F_UNLCK

    # ----- close ------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and close; the owner lock goes with the file descriptor."""
        self.arrays.clear()
        del self.data
        for view in reversed(self._views):
            view.release()
        self._views.clear()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # A caller still holds a view; the mapping goes when that view does.
                logger.warning("%s: a view outlives close(); unmapping later", self.path)
            self._mm = None
        os.close(self.fd)


def _map(fd: int, geometry: Geometry) -> mmap.mmap:
    _, data_offset = _array_offsets(geometry)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, data_offset + geometry.capacity_bytes, flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Where the kernel allows huge pages for shared memory (shmem_enabled=advise), they
        # save TLB misses on every large copy; elsewhere this is a no-op.
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    return mm


def _still_linked(fd: int, path: str) -> bool:
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)


def _read_geometry(path: str, head: bytes, file_size: int) -> Geometry:
    if head[:6] != MAGIC[:6]:
        raise BackendUnavailableError(
            f"{path} exists but is not a hicache shared memory segment (bad magic); remove it "
            "or choose another segment name"
        )
    if len(head) < HEADER_BYTES:
        raise BackendUnavailableError(f"{path} is truncated; unlink it")
    fields = struct.unpack_from(f"={HEADER_BYTES // 8}q", head)
    if head[:8] != MAGIC or fields[Hdr.VERSION] != VERSION:
        raise BackendUnavailableError(
            f"{path} was written by an incompatible hicache version; unlink it "
            "(SharedMemoryBackend.unlink_segment) once no process uses it"
        )
    geometry = Geometry(fields[Hdr.BLOCK_BYTES], fields[Hdr.N_BLOCKS], fields[Hdr.MAX_OBJECTS])
    _, data_offset = _array_offsets(geometry)
    if fields[Hdr.DATA_OFFSET] != data_offset or file_size < data_offset + geometry.capacity_bytes:
        raise BackendUnavailableError(f"{path}: the header does not match the file; unlink it")
    return geometry


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
