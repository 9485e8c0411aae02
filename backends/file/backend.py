"""``file://``: one file per object on a local or shared POSIX filesystem.

Layout: ``root/ab/cd/<key>``, where ``abcd`` are the first hex digits of ``xxh3_64(key)``, so no
directory holds more than a small share of the store. Directories are created on first use.
Paths are built from the validated key and the root only, so nothing outside root is touched.

Writes go to ``.<key>.<pid>.<random>.tmp`` in the final directory (the leading dot hides it from
scans; a crash leaves only such a file, for ``hicache compact`` to remove), then ``os.replace``
publishes the object atomically. A reader in any process therefore sees the old object or the
new one, never a mix, and its open descriptor keeps the inode alive if the object is replaced or
evicted while it reads. Data moves with ``os.writev``/``os.preadv`` straight between the caller's
segments and the kernel: no joined copy, no intermediate bytes.

The ``mtime`` that ``scan`` reports is the object's write time: reads do not refresh it (no
``utime`` per hit), so tools that evict by age (``hicache compact``) see write order.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import random
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar
from urllib.parse import unquote

import xxhash

from hicache.backends._io_threads import outlive_cancel
from hicache.backends.base import (
    MISS,
    TEMP_GRACE_S,
    Capabilities,
    ObjectInfo,
    StorageBackend,
    TempFile,
)
from hicache.backends.file.bulk_read import read_store
from hicache.backends.file.io import (
    aligned,
    fsync_dir,
    read_head,
    read_into,
    remove_if_stale,
    scan_top,
    temp_files_in,
    temp_files_under,
    top_dirs,
    unlink_quietly,
    write_all,
)
from hicache.backends.file.lru_index import LruIndex
from hicache.errors import BackendError, BackendUnavailableError, ConfigError

__all__ = ["FileBackend", "FileConfig"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound="FileBackend")

_TMP_KEY_CHARS = 200  # keeps ".<key>.<pid>.<random>.tmp" under NAME_MAX for 250-char keys
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | _CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC
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
)


@dataclass(frozen=True, slots=True)
class FileConfig:
    """Options of ``file:///path?fsync=true&o_direct=true&max_bytes=10G&io_threads=4``."""

    root: str
    fsync: bool = False  # fsync each file before its rename and the directory after it
    o_direct: bool = False  # O_DIRECT reads into one 4096-aligned segment; else buffered, counted
    max_bytes: int | None = None  # size cap of this process's view of the store (LRU eviction)
    io_threads: int = 4  # a batch is split into up to this many chunks, one thread each

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ConfigError("FileConfig.root must be a non-empty path")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(f"FileConfig.max_bytes must be positive, got {self.max_bytes}")
        if self.io_threads <= 0:
            raise ConfigError(f"FileConfig.io_threads must be positive, got {self.io_threads}")
        # Absolute once and for all: a later chdir in the process must not move the store.
        object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(self.root)))


class FileBackend(StorageBackend):
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
        self._root = config.root
        self._index = LruIndex(config.max_bytes, self._evict_locked)
        self._count_lock = threading.Lock()  # the counters; blocking calls run in threads
        self._n = dict.fromkeys(_COUNTERS, 0)
        self._warned: set[str] = set()
        self._o_direct = config.o_direct and bool(_O_DIRECT)  # off once the filesystem refuses
        if config.max_bytes is not None:  # an object larger than the cap is refused by put
            self.capabilities = replace(self.capabilities, max_object_bytes=config.max_bytes)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        if netloc not in ("", "localhost"):
            raise ConfigError(f"a file URL names a local path (file:///abs/path), not {netloc!r}")
        if not path:
            raise ConfigError("a file URL needs a path, for example file:///var/cache/hicache")
        return {"root": unquote(path)}

    @classmethod
    async def open(cls: type[F], config: Any) -> F:
        """Create root if needed, check it is a writable directory, and load the index."""
        backend = cls(config)
        await asyncio.to_thread(backend._prepare)
        return backend

    def _prepare(self) -> None:
        root = self._root
        try:
            os.makedirs(root, exist_ok=True)
            probe = f"{root}/.probe.{os.getpid()}.{random.getrandbits(48):012x}.tmp"
            os.close(os.open(probe, _WRITE_FLAGS, 0o600))
            os.unlink(probe)
        except OSError as exc:
            what = "is not a directory" if isinstance(exc, FileExistsError) else exc.strerror
            raise BackendUnavailableError(
                f"file backend root {root} is unusable ({what}): point root at a directory this "
                "process can create and write (check the path, its permissions and its mount)"
            ) from None
        found = [info for top in top_dirs(self._root) for info in scan_top(self._root, top, "")]
        found.sort(key=lambda info: info.mtime)
        self._index.load((info.key, info.size) for info in found)
        if self.config.o_direct and not _O_DIRECT:
            logger.warning("o_direct asked for but this platform has no O_DIRECT; reads buffered")

    # ----- backend operations: each key's work runs in a worker thread ------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        return await self._in_threads(self._exists_one, keys, keys)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        return await self._in_threads(self._get_one, keys, buffers)

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        return await self._in_threads(self._put_one, keys, values)

    async def _delete(self, keys: list[str]) -> list[bool]:
        return await self._in_threads(self._delete_one, keys, keys)

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        # One thread hop per first-level directory: bounded memory, and the loop stays free.
        for top in await asyncio.to_thread(top_dirs, self._root):
            for info in await asyncio.to_thread(scan_top, self._root, top, prefix):
                yield info

    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        return await self._in_threads(self._peek_one, keys, [nbytes] * len(keys))

    # ----- whole-store reads for the tools (the BulkReader protocol) ----------------------------
    async def read_all(
        self,
        prefix: str,
        check: Callable[[str, memoryview], T],
        *,
        threads: int = 2,
        processes: int = 0,
    ) -> AsyncGenerator[list[T], None]:
        """``check(key, data)`` for every object, one thread hop per few top-level directories.

        Each worker has its own buffer; like ``peek``, these reads leave the eviction order
        alone. One thread runs until the objects prove large: a small object's cost is mostly
        Python (the check, the walk), which the GIL serialises, and two threads handing it back
        and forth are slower than one; a large object's copy and checksum run without it. Small
        objects go to up to ``processes`` worker processes instead, when ``check`` can be sent
        to them (a module-level function) and the store is big enough to pay for starting them.
        """
        self._check_open()
        names = await asyncio.to_thread(top_dirs, self._root)
        outcomes = read_store(self._root, names, prefix, check, threads, processes)
        async with contextlib.aclosing(outcomes) as batches:
            async for outcome in batches:
                yield self._account(outcome)

    def _account(self, outcome: tuple[list[T], int, int]) -> list[T]:
        results, _, failed = outcome
        if failed:
            self._count_read_errors(failed)
        return results

    def _count_read_errors(self, failed: int) -> None:
        with self._count_lock:
            self._n["read_errors"] += failed
        self._warn_once("read", f"{failed} objects could not be read")

    # ----- temporary files of crashed writers (the TempFileOwner protocol) ----------------------
    async def scan_temp_files(self) -> AsyncIterator[TempFile]:
        """Every writer's temporary file, with its age; one thread hop per top directory."""
        self._check_open()
        for info in await asyncio.to_thread(temp_files_in, self._root, ""):  # open()'s probe
            yield info
        for top in await asyncio.to_thread(top_dirs, self._root):
            for info in await asyncio.to_thread(temp_files_under, self._root, top):
                yield info

    async def remove_temp_files(self, min_age_s: float = TEMP_GRACE_S) -> list[TempFile]:
        """Remove temporary files not written for ``min_age_s`` seconds; those removed."""
        removed: list[TempFile] = []
        async for info in self.scan_temp_files():
            if info.age_s >= min_age_s and await asyncio.to_thread(
                remove_if_stale, f"{self._root}/{info.path}", min_age_s
            ):
                removed.append(info)
        return removed

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
        self, fn: Callable[[str, Any], T], keys: list[str], items: Sequence[Any]
    ) -> list[T]:
        """``fn(key, item)`` for each pair, in up to ``io_threads`` chunks; results in order."""

        def run(lo: int, hi: int) -> list[T]:
            return [fn(keys[i], items[i]) for i in range(lo, hi)]

        n = len(keys)
        step = -(-n // max(1, min(self.config.io_threads, n)))
        work = asyncio.gather(
            *(asyncio.to_thread(run, i, min(i + step, n)) for i in range(0, n, step))
        )
        chunks = await outlive_cancel(work)
        return [result for chunk in chunks for result in chunk]

    def _dir_of(self, key: str) -> str:
        h = xxhash.xxh3_64_hexdigest(key.encode())
        return f"{self._root}/{h[0:2]}/{h[2:4]}"

    # ----- exists / delete ----------------------------------------------------------------------
    def _exists_one(self, key: str, _: object) -> bool:
        return os.path.isfile(f"{self._dir_of(key)}/{key}")

    def _delete_one(self, key: str, _: object) -> bool:
        path = f"{self._dir_of(key)}/{key}"
        # Under the index lock so that an eviction cannot interleave with it.
        with self._index.lock:
            try:
                os.unlink(path)
                found = True
            except FileNotFoundError:
                found = False
            except OSError as exc:
                raise BackendError(f"cannot delete {path}: {exc.strerror}") from exc
            self._index.drop_locked(key)
        return found

    def _peek_one(self, key: str, nbytes: int) -> bytes | None:
        # No pin and no index update: a tool reading headers must not change eviction order.
        try:
            return read_head(f"{self._dir_of(key)}/{key}", nbytes)
        except OSError as exc:
            self._bump("read_errors")
            self._warn_once("read", f"read of {key!r} failed: {exc}")
            return None

    # ----- put ------------------------------------------------------------------------------
    def _put_one(self, key: str, segs: list[memoryview]) -> bool:
        size = sum(s.nbytes for s in segs)
        if self.config.max_bytes is not None and size > self.config.max_bytes:
            self._bump("put_too_large")
            return False
        directory = self._dir_of(key)
        tmp = ""
        try:
            tmp = self._write_temp(directory, key, segs, size)
            if not self._index.admit(key, size):
                unlink_quietly(tmp)
                self._bump("put_no_room")
                return False
            try:
                os.replace(tmp, f"{directory}/{key}")
                tmp = ""
            finally:
                self._index.settle(key, None, present=not tmp)
            if self.config.fsync:  # on failure the object is visible, but maybe not durable
                fsync_dir(directory)
            return True
        except OSError as exc:
            if tmp:
                unlink_quietly(tmp)
            self._put_failed(key, exc)
            return False

    def _write_temp(self, directory: str, key: str, segs: list[memoryview], size: int) -> str:
        """A complete temporary copy of the object next to its final path; its path."""
        tmp = f"{directory}/.{key[:_TMP_KEY_CHARS]}.{os.getpid()}.{random.getrandbits(48):012x}.tmp"
        try:
            fd = os.open(tmp, _WRITE_FLAGS, 0o666)
        except FileNotFoundError:
            self._make_dirs(directory)
            fd = os.open(tmp, _WRITE_FLAGS, 0o666)
        try:
            try:
                write_all(fd, segs, size)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            unlink_quietly(tmp)
            raise
        return tmp

    def _make_dirs(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        if self.config.fsync:  # new directory entries must survive a crash with the object
            fsync_dir(os.path.dirname(directory))
            fsync_dir(self._root)

    def _put_failed(self, key: str, exc: OSError) -> None:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        with self._count_lock:
            self._n["put_errors"] += 1
            self._n["enospc"] += full
        self._warn_once("enospc" if full else "put", f"put of {key!r} failed: {exc}")

    # ----- get ------------------------------------------------------------------------------
    def _get_one(self, key: str, segs: list[memoryview]) -> int:
        self._index.pin(key)
        size, present = MISS, True
        try:
            size = self._read(f"{self._dir_of(key)}/{key}", segs)
        except FileNotFoundError:
            present = False
        except OSError as exc:
            self._bump("read_errors")
            self._warn_once("read", f"read of {key!r} failed: {exc}")
        finally:
            self._index.settle(key, size if size >= 0 else None, present)
        return size

    def _read(self, path: str, segs: list[memoryview]) -> int:
        """Object size; its bytes are in ``segs`` when they fit. MISS for a short read."""
        single = len(segs) == 1
        direct = self._o_direct and single and aligned(segs[0])
        fd, direct = self._open_for_read(path, direct)
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

    def _open_for_read(self, path: str, direct: bool) -> tuple[int, bool]:
        if direct:
            try:
                return os.open(path, _READ_FLAGS | _O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refuse_o_direct()  # tmpfs before Linux 6.6, some FUSE filesystems
        return os.open(path, _READ_FLAGS), False

    def _refuse_o_direct(self) -> None:
        self._o_direct = False  # for good: this filesystem will refuse every time
        self._warn_once("o_direct", f"{self._root} refuses O_DIRECT; reads are buffered")

    # ----- eviction (called by the index, under its lock) ----------------------------------
    def _evict_locked(self, key: str) -> None:
        try:
            os.unlink(f"{self._dir_of(key)}/{key}")
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn_once("evict", f"cannot evict {key!r}: {exc}")

    def _bump(self, counter: str) -> None:
        with self._count_lock:
            self._n[counter] += 1

    def _warn_once(self, kind: str, message: str) -> None:
        # A full disk fails every put; one warning per kind says it, the counters say how often.
        # No lock: eviction calls this while holding it, and a race costs one duplicate line.
        first = kind not in self._warned
        self._warned.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, "%s (root %s)", message, self._root)
