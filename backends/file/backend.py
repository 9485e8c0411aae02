"""``file://``: one file per object on a local or shared POSIX filesystem.

Layout: ``root/ab/cd/<key>``, where ``abcd`` are the first hex digits of ``xxh3_64(key)``, so no
directory holds more than a small share of the store. Directories are created on first use.

Nothing outside the root is touched, whoever writes inside it: the root is resolved once, at
open (it may be reached through a link of the operator's), and every component below it is
walked without following links (see :mod:`.tree`). A fan-out directory or an object that is a
symbolic link is refused: a miss for ``get``, ``exists`` and ``peek``, False for a ``put``
into it, nothing unlinked by ``delete`` or eviction, skipped by listings; each refusal is
counted (``links_refused``) and the first one logged. A ``put`` over an object that is a link
replaces the link itself, as the rename does, never its target.

Writes go to ``.<key>.<pid>.<random>.tmp`` in the final directory (the leading dot hides it from
scans; a crash leaves only such a file, for ``hicache compact`` to remove), then a rename
publishes the object atomically. A reader in any process therefore sees the old object or the
new one, never a mix, and its open descriptor keeps the inode alive if the object is replaced or
evicted while it reads. Data moves with ``os.writev``/``os.preadv`` straight between the caller's
segments and the kernel: no joined copy, no intermediate bytes.

``read_only=true`` opens an existing store without writing anything (no directory created, no
write probe, no eviction): what the tools that only read use, on read-only mounts too. Its
``put``, ``delete`` and temporary-file removal raise :class:`ReadOnlyStoreError`.

The ``mtime`` that ``scan`` reports is the object's write time: reads do not refresh it (no
``utime`` per hit), so tools that evict by age (``hicache compact``) see write order.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import stat
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from hicache.backends._io_threads import outlive_cancel
from hicache.backends._open_flags import CLOEXEC
from hicache.backends._prepared_open import PreparedInThread
from hicache.backends._urls import local_root
from hicache.backends.base import Capabilities, ObjectInfo
from hicache.backends.file.config import FileConfig
from hicache.backends.file.io import write_all
from hicache.backends.file.lru_index import LruIndex
from hicache.backends.file.reads import ObjectReads
from hicache.backends.file.scan import scan_top, top_dirs
from hicache.backends.file.store_maintenance import StoreMaintenance
from hicache.backends.file.tree import (
    LinkRefusedError,
    fan_of,
    make_leaf,
    object_stat,
    open_leaf,
    open_object,
    unlink_object,
    unlink_quietly_at,
    use_openat2,
)
from hicache.errors import (
    BackendError,
    BackendUnavailableError,
    ReadOnlyStoreError,
)

__all__ = ["FileBackend", "FileConfig"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TMP_KEY_CHARS = 200  # keeps ".<key>.<pid>.<random>.tmp" under NAME_MAX for 250-char keys
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC  # O_EXCL: never follows a link
_KEY_OP_BYTES = 64 << 10  # what a key-only call (exists, delete, peek) counts a key as
# Counters of this backend, on top of the base's (evictions: the index's).
_COUNTERS = (
    "enospc",
    "put_errors",
    "put_too_large",
    "put_no_room",
    "read_errors",
    "short_reads",
    "o_direct_reads",
    "o_direct_fallbacks",
    "links_refused",
)


class FileBackend(ObjectReads, StoreMaintenance, PreparedInThread):
    """Objects as files under ``root``, with an optional size cap and LRU eviction.

    The cap is enforced per process: the LRU index is built by scanning root at open (ordered by
    mtime, so a restart is warm and the cap holds across restarts) and kept up to date by this
    process's puts, reads and deletes. Objects other processes write are seen at the next open or
    when this process reads them. That is acceptable because the store is a cache: overshooting
    the cap between opens costs disk space, never correctness, and a global index would need a
    lock shared by every process on every operation. Run one capped process per root (or give
    each writer its share of the budget) when the cap must be exact. Temporary files of puts in
    flight are not counted, so disk use may exceed the cap by up to ``io_threads`` objects.
    Recency from reads lives in memory only; after a restart the order is by write time.
    """

    name = "file"
    url_schemes = ("file",)
    url_parts = frozenset({"host", "path"})  # the host may only be localhost: checked below
    capabilities = Capabilities(
        persistent=True, shared_across_processes=True, zero_copy=False, listable=True
    )
    config_type = FileConfig

    def __init__(self, config: FileConfig) -> None:
        super().__init__()
        self.config = config
        self._root = config.root  # resolved at open: no link is followed below it
        cap = None if config.read_only else config.max_bytes  # a reader evicts nothing
        self._index = LruIndex(cap, self._evict_locked)
        self._count_lock = threading.Lock()  # the counters; blocking calls run in threads
        self._n = dict.fromkeys(_COUNTERS, 0)
        self._warned: set[str] = set()
        self._o_direct = config.o_direct and bool(_O_DIRECT)  # off once the filesystem refuses
        if config.max_bytes is not None:  # an object larger than the cap is refused by put
            self.capabilities = replace(self.capabilities, max_object_bytes=config.max_bytes)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        example = "file:///var/cache/hicache"
        return local_root(netloc, path, "file", "a local path (file:///abs/path)", example)

    def _prepare(self) -> None:
        """Create root if needed, check it is a writable directory, and load the index (a
        read-only open only checks that root is a directory)."""
        self._root = self._existing_root() if self.config.read_only else self._writable_root()
        use_openat2(self._root)
        found = [info for top in top_dirs(self._root) for info in scan_top(self._root, top, "")]
        found.sort(key=lambda info: info.mtime)
        self._index.load((info.key, info.size) for info in found)
        if self.config.o_direct and not _O_DIRECT:
            logger.warning("o_direct asked for but this platform has no O_DIRECT; reads buffered")

    def _writable_root(self) -> str:
        root = self.config.root
        try:
            os.makedirs(root, exist_ok=True)
            real = os.path.realpath(root)
            probe = f"{real}/.probe.{os.getpid()}.{random.getrandbits(48):012x}.tmp"
            os.close(os.open(probe, _WRITE_FLAGS, 0o600))
            os.unlink(probe)
        except OSError as exc:
            what = "is not a directory" if isinstance(exc, FileExistsError) else exc.strerror
            raise BackendUnavailableError(
                f"file backend root {root} is unusable ({what}): point root at a directory this "
                "process can create and write (check the path, its permissions and its mount)"
            ) from None
        return real

    def _existing_root(self) -> str:
        real = os.path.realpath(self.config.root)
        if not os.path.isdir(real):
            raise BackendUnavailableError(
                f"no store at {self.config.root} (no such directory): a read-only open creates "
                "nothing; check the path"
            )
        return real

    # ----- backend operations: each key's work runs in a worker thread ------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self._in_threads(self._exists_one, keys, keys, _KEY_OP_BYTES * len(keys))

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        nbytes = sum(s.nbytes for segs in buffers for s in segs)
        return await self._in_threads(self._get_one, keys, buffers, nbytes)

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        self._check_writable("put")
        nbytes = sum(s.nbytes for segs in values for s in segs)
        return await self._in_threads(self._put_one, keys, values, nbytes)

    async def _delete(self, keys: list[str]) -> list[bool]:
        self._check_writable("delete")
        return await self._in_threads(self._delete_one, keys, keys, _KEY_OP_BYTES * len(keys))

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        # One thread hop per first-level directory: bounded memory, and the loop stays free.
        for top in await asyncio.to_thread(top_dirs, self._root):
            for info in await asyncio.to_thread(scan_top, self._root, top, prefix):
                yield info

    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        return await self._in_threads(
            self._peek_one, keys, [nbytes] * len(keys), _KEY_OP_BYTES * len(keys)
        )

    def _check_writable(self, what: str) -> None:
        if self.config.read_only:
            raise ReadOnlyStoreError(
                f"{what} refused: the file store at {self.config.root} was opened read-only"
            )

    async def _stats(self) -> dict[str, int | float]:
        with self._count_lock:
            out: dict[str, int | float] = dict(self._n)
        with self._index.lock:
            out.update(objects=len(self._index), used_bytes=self._index.used)
            out["evictions"] = self._index.evictions
        out["max_bytes"] = self.config.max_bytes or 0
        return out

    async def _close(self) -> None:
        self._index.clear()

    async def _in_threads(
        self, fn: Callable[[str, Any], T], keys: list[str], items: Sequence[Any], nbytes: int
    ) -> list[T]:
        """``fn(key, item)`` for each pair, in up to ``io_threads`` chunks of at least
        ``thread_min_bytes`` each (of the call's ``nbytes``); results in order."""

        def run(lo: int, hi: int) -> list[T]:
            return [fn(keys[i], items[i]) for i in range(lo, hi)]

        n = len(keys)
        threads = min(self.config.io_threads, n, max(1, nbytes // self.config.thread_min_bytes))
        step = -(-n // max(1, threads))
        work = asyncio.gather(
            *(asyncio.to_thread(run, i, min(i + step, n)) for i in range(0, n, step))
        )
        chunks = await outlive_cancel(work)
        return [result for chunk in chunks for result in chunk]

    # ----- exists / delete ----------------------------------------------------------------------
    def _exists_one(self, key: str, _: object) -> bool:
        try:
            leaf = open_leaf(self._root, fan_of(key))
            try:
                st = object_stat(leaf, key)
            finally:
                os.close(leaf)
        except LinkRefusedError as exc:
            self._refused(key, exc)
            return False
        except OSError:
            return False
        return st is not None and stat.S_ISREG(st.st_mode)

    def _delete_one(self, key: str, _: object) -> bool:
        # Under the index lock so that an eviction cannot interleave with it.
        with self._index.lock:
            try:
                found = self._unlink(key)
            except OSError as exc:
                raise BackendError(
                    f"cannot delete {key!r} under {self._root}: {exc.strerror}"
                ) from exc
            self._index.drop_locked(key)
        return found

    def _unlink(self, key: str) -> bool:
        """Unlink ``key``'s object; False when it is absent or refused (a link, counted)."""
        try:
            leaf = open_leaf(self._root, fan_of(key))
            try:
                return unlink_object(leaf, key)
            finally:
                os.close(leaf)
        except LinkRefusedError as exc:
            self._refused(key, exc)
        except FileNotFoundError:
            pass
        return False

    # ----- put ------------------------------------------------------------------------------
    def _put_one(self, key: str, segs: list[memoryview]) -> bool:
        size = sum(s.nbytes for s in segs)
        if self.config.max_bytes is not None and size > self.config.max_bytes:
            self._bump("put_too_large")
            return False
        fan = fan_of(key)
        try:
            try:
                leaf = open_leaf(self._root, fan)
            except FileNotFoundError:
                leaf = make_leaf(self._root, fan, self.config.fsync)
        except LinkRefusedError as exc:
            self._refused(key, exc)
            return False
        except OSError as exc:
            self._put_failed(key, exc)
            return False
        try:
            return self._publish(leaf, key, segs, size)
        finally:
            os.close(leaf)

    def _publish(self, leaf: int, key: str, segs: list[memoryview], size: int) -> bool:
        """Write ``key``'s object into its open directory ``leaf`` and rename it into place."""
        tmp = ""
        try:
            tmp = self._write_temp(leaf, key, segs, size)
            if not self._index.admit(key, size):
                unlink_quietly_at(leaf, tmp)
                self._bump("put_no_room")
                return False
            try:
                os.replace(tmp, key, src_dir_fd=leaf, dst_dir_fd=leaf)
                tmp = ""
            finally:
                self._index.settle(key, None, present=not tmp)
            if self.config.fsync:  # on failure the object is visible, but maybe not durable
                os.fsync(leaf)
            return True
        except OSError as exc:
            if tmp:
                unlink_quietly_at(leaf, tmp)
            self._put_failed(key, exc)
            return False

    def _write_temp(self, leaf: int, key: str, segs: list[memoryview], size: int) -> str:
        """A complete temporary copy of the object in its directory ``leaf``; its name."""
        tmp = f".{key[:_TMP_KEY_CHARS]}.{os.getpid()}.{random.getrandbits(48):012x}.tmp"
        fd = open_object(leaf, tmp, _WRITE_FLAGS)
        try:
            try:
                write_all(fd, segs, size)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            unlink_quietly_at(leaf, tmp)
            raise
        return tmp

    def _put_failed(self, key: str, exc: OSError) -> None:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        with self._count_lock:
            self._n["put_errors"] += 1
            self._n["enospc"] += full
        self._warn_once("enospc" if full else "put", f"put of {key!r} failed: {exc}")

    # ----- eviction (called by the index, under its lock) ----------------------------------
    def _evict_locked(self, key: str) -> None:
        try:
            self._unlink(key)
        except OSError as exc:
            self._warn_once("evict", f"cannot evict {key!r}: {exc}")

    def _refused(self, key: str, exc: OSError) -> None:
        self._bump("links_refused")
        self._warn_once(
            "link",
            f"refused the symbolic link {exc.filename!r} on the way to {key!r}: nothing outside "
            "the store is read, written or removed (who plants links in it?)",
        )

    def _bump(self, counter: str, amount: int = 1) -> None:
        with self._count_lock:
            self._n[counter] += amount

    def _warn_once(self, kind: str, message: str) -> None:
        # A full disk fails every put; one warning per kind says it, the counters say how often.
        # No lock: eviction calls this while holding it, and a race costs one duplicate line.
        first = kind not in self._warned
        self._warned.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, "%s (root %s)", message, self._root)
