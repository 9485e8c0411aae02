"""The ``file`` backend's reads: ``get_into`` and ``peek`` of one object, with O_DIRECT.

A mixin of :class:`~hicache.backends.file.backend.FileBackend`, kept apart so that each module
stays small. Each object is opened through its directories without following a link (see
:mod:`.tree`); a link is a miss, counted by the backend.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable

from hicache.backends.base import MISS
from hicache.backends.file.config import FileConfig
from hicache.backends.file.io import aligned, read_into
from hicache.backends.file.lru_index import LruIndex
from hicache.backends.file.tree import (
    READ_FLAGS,
    LinkRefusedError,
    fan_of,
    open_key,
)

__all__ = ["ObjectReads"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class ObjectReads:
    """``_get_one`` and ``_peek_one``: what the backend's reads run in worker threads."""

    # Provided by the backend.
    config: FileConfig
    _root: str
    _index: LruIndex
    _o_direct: bool
    _bump: Callable[..., None]
    _warn_once: Callable[[str, str], None]
    _refused: Callable[[str, OSError], None]

    def _open(self, key: str, flags: int) -> int:
        """``key``'s object, opened with ``flags`` through its directories, no link followed."""
        return open_key(self._root, fan_of(key), key, flags)

    # ----- get ------------------------------------------------------------------------------
    def _get_one(self, key: str, segs: list[memoryview]) -> int:
        self._index.pin(key)
        size, present = MISS, True
        try:
            size = self._read(key, segs)
        except FileNotFoundError:
            present = False
        except LinkRefusedError as exc:
            present = False
            self._refused(key, exc)
        except OSError as exc:
            self._bump("read_errors")
            self._warn_once("read", f"read of {key!r} failed: {exc}")
        finally:
            self._index.settle(key, size if size >= 0 else None, present)
        return size

    def _read(self, key: str, segs: list[memoryview]) -> int:
        """Object size; its bytes are in ``segs`` when they fit. MISS for a short read."""
        single = len(segs) == 1
        direct = self._o_direct and single and aligned(segs[0])
        fd, direct = self._open_for_read(key, direct)
        try:
            size: int = os.fstat(fd).st_size
            if size > (segs[0].nbytes if single else sum(s.nbytes for s in segs)):
                return size
            try:
                got = read_into(fd, segs, size)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                # Some filesystems accept O_DIRECT at open and refuse the read itself.
                self._refuse_o_direct()
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
                direct = False
                got = read_into(fd, segs, size)
        finally:
            os.close(fd)
        if self.config.o_direct:
            self._bump("o_direct_reads" if direct else "o_direct_fallbacks")
        if got < size:  # impossible with rename-only writers; a foreign writer truncated it
            self._bump("short_reads")
            return MISS
        return size

    def _open_for_read(self, key: str, direct: bool) -> tuple[int, bool]:
        if direct:
            try:
                return self._open(key, READ_FLAGS | _O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refuse_o_direct()  # tmpfs before Linux 6.6, some FUSE filesystems
        return self._open(key, READ_FLAGS), False

    def _refuse_o_direct(self) -> None:
        self._o_direct = False  # for good: this filesystem will refuse every time
        self._warn_once("o_direct", f"{self._root} refuses O_DIRECT; reads are buffered")

    def _peek_one(self, key: str, nbytes: int) -> bytes | None:
        # No pin and no index update: a tool reading headers must not change eviction order.
        try:
            fd = self._open(key, READ_FLAGS)
            try:
                return os.pread(fd, nbytes, 0)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except LinkRefusedError as exc:
            self._refused(key, exc)
            return None
        except OSError as exc:
            self._bump("read_errors")
            self._warn_once("read", f"read of {key!r} failed: {exc}")
            return None
