"""The open segments a ``disk`` writer appends to, and the writes into them.

A writer slot has one segment lane, or two where its batches are large enough to share: a
large batch is cut in two by bytes and each half written into a segment of its own by its own
thread. Two threads writing halves of one file take turns on its lock (2.9 GB/s here, against
4.2 from one), while two files written at once went at 9.9 GB/s against 7.1 for one (64 pages
of 8 MiB, settled memory, eight alternating rounds; docs/BENCHMARKS.md, issue 48). A lane's
records are still written before the batch's one log frame names any of them, so a crash
leaves no indexed record torn.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

from hicache.backends.disk.catalog import Catalog
from hicache.backends.disk.config import DiskConfig
from hicache.backends.disk.direct import DirectTail, open_direct
from hicache.backends.disk.format import SEGMENT_HEADER, segment_code
from hicache.backends.disk.segments import create_segment, next_number, segment_name
from hicache.backends.segments import segments_after, split_iov

__all__ = ["LaneShared", "SegmentLane"]

logger = logging.getLogger(__name__)


class LaneShared:
    """What a slot's lanes share: the store, the slot, its counters and a lock for them (two
    lanes may fail or start a segment at once)."""

    def __init__(self, catalog: Catalog, config: DiskConfig, slot: int, lock_fd: int) -> None:
        self.catalog = catalog
        self.config = config
        self.slot = slot
        self.lock_fd = lock_fd
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("put_errors", "enospc", "put_too_large", "snapshots", "bytes_staged",
             "direct_fallbacks"), 0
        )  # fmt: skip

    def count_error(self, exc: OSError, what: str) -> None:
        with self.lock:
            self.counts["put_errors"] += 1
            self.counts["enospc"] += exc.errno in (errno.ENOSPC, errno.EDQUOT)
        logger.warning("disk store %s: %s: %s", self.catalog.dirs.root, what, exc)


class SegmentLane:
    """One open segment (``code``, written up to ``end``) and its writes; none open before the
    first write or after a failed one (``code`` is -1 then)."""

    def __init__(self, shared: LaneShared) -> None:
        self.shared = shared
        self.code = -1
        self.fd = -1
        self.end = 0
        self._direct_fd = -1  # the open segment's O_DIRECT descriptor (direct=true)
        self._tail: DirectTail | None = None

    @property
    def is_open(self) -> bool:
        return self.fd >= 0

    def start_segment(self) -> bool:
        """Seal the open segment and start a new one; False (counted) where none can start."""
        self.seal()
        shared = self.shared
        try:
            with shared.lock:  # the slot's segment numbers come from one counter in its lock file
                number = next_number(shared.lock_fd)
            fd = create_segment(
                shared.catalog.dirs.segments,
                shared.slot,
                number,
                time.time_ns(),
                shared.catalog.dirs.segment_bytes,
            )
        except OSError as exc:
            shared.count_error(exc, "cannot start a segment")
            return False
        self.code, self.fd, self.end = segment_code(shared.slot, number), fd, SEGMENT_HEADER
        if shared.config.direct:
            self._open_direct(number)
        return True

    def write(self, iov: list[memoryview | bytes], offset: int, nbytes: int) -> bool:
        """One run of ``nbytes`` of records at ``offset`` of the open segment; False (counted)
        on failure, after which the segment is sealed and the next write starts a new one."""
        fsync = self.shared.config.fsync
        try:
            if self._direct_fd >= 0:
                assert self._tail is not None
                staged = self._tail.write(self._direct_fd, iov, offset, nbytes)
                with self.shared.lock:
                    self.shared.counts["bytes_staged"] += staged
                if fsync:
                    os.fdatasync(self._direct_fd)
                return True
            for part, at, want in split_iov(iov, offset, 1):  # more than IOV_MAX pieces: cut
                self._pwrite_all(part, at, want)
            if fsync:
                os.fdatasync(self.fd)
            return True
        except OSError as exc:
            self.shared.count_error(exc, "a write failed")
            self.seal()
            return False

    def _pwrite_all(self, iov: list[memoryview | bytes], offset: int, want: int) -> None:
        """``iov`` at ``offset``, whole."""
        done = os.pwritev(self.fd, iov, offset)
        while done < want:  # rare (a signal, a filesystem's limit): go on from where it stopped
            rest = segments_after([memoryview(p) for p in iov], done)
            n = os.pwritev(self.fd, rest, offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "segment write made no progress")
            done += n

    def _open_direct(self, number: int) -> None:
        """The new segment's O_DIRECT descriptor, and the copy of its first block; buffered
        writes (counted, warned once) where the filesystem has no direct I/O."""
        shared = self.shared
        fd = open_direct(segment_name(self.code), shared.catalog.dirs.segments, os.O_WRONLY)
        if fd is None:
            with shared.lock:
                shared.counts["direct_fallbacks"] += 1
                first = shared.counts["direct_fallbacks"] == 1
            if first:
                logger.warning("disk store %s: no O_DIRECT on this filesystem; writes buffered",
                               shared.catalog.dirs.root)  # fmt: skip
            return
        self._direct_fd = fd
        self._tail = DirectTail(os.pread(self.fd, SEGMENT_HEADER, 0))

    def seal(self) -> None:
        """Close the open segment (its records stay; a later write starts a new one)."""
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
        self._direct_fd, self._tail = -1, None
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.code = -1, -1
