"""The ``3fs`` backend's USRBIO engine: a thin adapter over 3FS's ``hf3fs_py_usrbio`` module.

Only the documented API is used: ``register_fd``/``deregister_fd``, ``extract_mount_point``,
``iovec(buffer, id, mount, block_size, numa)`` and ``ioring(mount, entries, for_read, io_depth,
priority, timeout, numa, flags)`` with ``prepare(iov, read, fd, offset, userdata=...)``,
``submit()`` and ``wait(min_results=n)``, whose results carry ``.result`` (bytes or -errno) and
the ``.userdata`` given to ``prepare``.

USRBIO moves data only between a file and an iovec, a shared-memory buffer the 3FS daemon has
mapped. Each I/O thread owns a *lane*: a ``/dev/shm`` segment wrapped as an iovec (announced to
the daemon by a symlink under ``<mount>/3fs-virt/iovs/<uuid>``) plus one read ring and one write
ring. A batch is staged through the lane: writes copy the caller's segments in, then prepare
one I/O per slot, submit once and wait for all; reads do the reverse. Lanes are never shared
between threads, because a ring is not thread-safe.
"""

from __future__ import annotations

import errno
import importlib
import logging
import mmap
import os
import queue
import uuid
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from hicache.backends.base import copy_into_segments, segments_nbytes
from hicache.backends.hf3fs.posix import IOItem
from hicache.errors import BackendUnavailableError

__all__ = ["UsrbioSlotIO", "find_usrbio"]

logger = logging.getLogger(__name__)

_MODULE = "hf3fs_py_usrbio"
_ALIGN = 4096  # each I/O starts block-aligned in the staging buffer
_SHM_DIR = "/dev/shm"


def find_usrbio(root: str, required: bool) -> tuple[ModuleType, str] | None:
    """(module, mount point) when USRBIO can serve ``root``; else None, or an error if required."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError:
        if required:
            raise BackendUnavailableError(
                "mode=usrbio needs the hf3fs_py_usrbio module (3FS's Python client, built from "
                "the 3FS source; it is not on PyPI): install it, or use mode=posix"
            ) from None
        return None
    try:
        mount = module.extract_mount_point(root)
    except OSError:
        mount = None
    if mount is None or not os.path.isdir(f"{mount}/3fs-virt/iovs"):
        if required:
            raise BackendUnavailableError(
                f"mode=usrbio: root {root} is not on a 3FS mount (no <mount>/3fs-virt/iovs): "
                "mount 3FS and put root inside it, or use mode=posix"
            )
        return None
    return module, str(mount)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Lane:
    """One thread's staging iovec over ``/dev/shm`` and its read and write rings."""

    def __init__(self, module: ModuleType, mount: str, nbytes: int, entries: int) -> None:
        self.nbytes, self.entries = nbytes, entries
        self.rings: dict[bool, Any] = {}
        shm_path = f"{_SHM_DIR}/hicache-3fs-{uuid.uuid4().hex}"
        fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mem = mmap.mmap(fd, nbytes)
            iov_id = str(uuid.uuid4())
            self.link = f"{mount}/3fs-virt/iovs/{iov_id}"
            os.symlink(shm_path, self.link)  # how the daemon learns of the buffer
            self.iov: Any = module.iovec(self.mem, iov_id, mount, 0, -1)
            for for_read in (True, False):
                self.rings[for_read] = module.ioring(mount, entries, for_read, 0, None, None, -1, 0)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)
            os.unlink(shm_path)  # mapped by us and the daemon: no name left to leak on a crash
        self.view = memoryview(self.mem)

    def run(self, fd: int, items: Sequence[IOItem], for_read: bool) -> list[int]:
        """Move every item through this lane, as many per round as fit; bytes or -errno each."""
        results = [-errno.EIO] * len(items)
        i = 0
        while i < len(items):
            batch: list[tuple[int, int, int]] = []  # (item, lane offset, bytes)
            pos = 0
            while i < len(items) and len(batch) < self.entries:
                n = segments_nbytes(items[i][1])
                if n > self.nbytes:
                    results[i], i = -errno.EINVAL, i + 1  # cannot happen: lanes hold a slot
                    continue
                if pos + n > self.nbytes:
                    break
                batch.append((i, pos, n))
                pos += _round_up(n)
                i += 1
            self._round(fd, items, batch, for_read, results)
        return results

    def _round(
        self,
        fd: int,
        items: Sequence[IOItem],
        batch: list[tuple[int, int, int]],
        for_read: bool,
        results: list[int],
    ) -> None:
        ring = self.rings[for_read]
        prepared = 0
        for i, pos, n in batch:
            if not for_read:
                _gather(items[i][1], self.view[pos : pos + n])
            try:
                ring.prepare(self.iov[pos : pos + n], for_read, fd, items[i][0], userdata=i)
                prepared += 1
            except OSError as exc:
                results[i] = -(exc.errno or errno.EIO)
        try:
            for done in _complete(ring, prepared):
                results[done.userdata] = done.result
        except OSError as exc:
            # Only a dead daemon fails a wait; the items not yet reported count as failed.
            logger.error("3FS ioring wait failed: %s", exc)
            for i, _, _ in batch:
                if results[i] == -errno.EIO:
                    results[i] = -(exc.errno or errno.EIO)
        if for_read:
            for i, pos, n in batch:
                if results[i] == n:
                    copy_into_segments(self.view[pos : pos + n], items[i][1])

    def close(self) -> None:
        self.rings = {}
        self.iov = None  # released before the mapping it points into
        if os.path.lexists(getattr(self, "link", "")):
            os.unlink(self.link)  # tells the daemon the buffer is gone
        view = getattr(self, "view", None)
        if view is not None:
            view.release()
        mem = getattr(self, "mem", None)
        try:
            if mem is not None:
                mem.close()
        except BufferError:  # a view is still exported somewhere: the mapping goes with it
            logger.debug("3FS staging buffer still referenced; left to the collector")


def _gather(segs: Sequence[memoryview], target: memoryview) -> None:
    offset = 0
    for seg in segs:
        target[offset : offset + seg.nbytes] = seg
        offset += seg.nbytes


def _complete(ring: Any, prepared: int) -> list[Any]:
    """Submit what was prepared and wait until every one of them has completed."""
    done: list[Any] = []
    if prepared:
        ring.submit()
    while len(done) < prepared:
        done.extend(ring.wait(min_results=prepared - len(done)))
    return done


class UsrbioSlotIO:
    """The USRBIO engine for one registered file: ``lanes`` lanes of ``lane_bytes`` each."""

    def __init__(
        self, usrbio: tuple[ModuleType, str], fd: int, lanes: int, lane_bytes: int
    ) -> None:
        module, mount = usrbio
        self._module, self._fd = module, fd
        module.register_fd(fd)  # USRBIO refuses I/O on a descriptor it was not told about
        self._pool: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        self._lanes: list[_Lane] = []
        entries = max(1, min(1024, lane_bytes // _ALIGN))  # the most I/Os one round can hold
        try:
            for _ in range(lanes):
                lane = _Lane(module, mount, lane_bytes, entries)
                self._lanes.append(lane)
                self._pool.put(lane)
        except BaseException:
            self.close()
            raise

    def write(self, items: Sequence[IOItem]) -> list[int]:
        return self._run(items, for_read=False)

    def read(self, items: Sequence[IOItem]) -> list[int]:
        return self._run(items, for_read=True)

    def _run(self, items: Sequence[IOItem], for_read: bool) -> list[int]:
        lane = self._pool.get()  # one per I/O thread, so this never waits in practice
        try:
            return lane.run(self._fd, items, for_read)
        finally:
            self._pool.put(lane)

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()
        self._lanes.clear()
        if self._fd >= 0:
            self._module.deregister_fd(self._fd)  # before the owner closes the descriptor
            self._fd = -1
