"""``3fs://`` (or ``hf3fs://``): one preallocated file of fixed page slots per rank, on 3FS.

Layout: ``<root>/hicache-rank{rank}.data`` holds ``slots`` slots; slot ``i`` starts at
``i * stride`` with a 4 KiB slot header (which write owns the slot) followed by the object, up
to ``slot_bytes`` bytes. ``<root>/hicache-rank{rank}.index`` is an append-only log of
checksummed, fixed-size records (key -> slot, size, write sequence number, time), replayed at
open and compacted when superseded records pile up; replay keeps write order, so a restart is
warm with least recently *written* first.

Write order: a put writes into a free slot (never the one its key occupies, so a concurrent
reader of the old version is never torn), then appends its index record, then releases the old
slot. A slot goes back to the free list only once the record that made it dead is written and no
reader holds it, and it is zeroed first, so no stale record can ever find an intact old object
there. A read checks the slot header against the index entry; anything else (a crash between
data and index with ``fsync=false``, a damaged record) reads as a miss, never as wrong bytes.

Full: the least recently used object not being read is evicted (its delete record is written
before its slot is reused). An object larger than ``slot_bytes`` is refused (put returns False).

Modes: ``usrbio`` moves data with 3FS's USRBIO rings through shared-memory staging buffers
(the object bytes copied count as ``bytes_staged``); ``posix`` uses ``pwritev``/``preadv`` on
the same file, straight from and into the caller's segments (``bytes_staged`` stays 0); ``auto``
picks USRBIO when ``hf3fs_py_usrbio`` imports and root is on a 3FS mount. One process writes a
rank: the data file is ``flock``-ed at open.

Links: keys never become paths here (they live in the index), so the only paths are the rank's
files directly in root. Root may be reached through the operator's links; the files in it are
opened with ``O_NOFOLLOW`` (a link there fails the open with :class:`BackendUnavailableError`,
see ``posix.open_store_file``), and the index rewrite creates its temporary file with
``O_EXCL``, so nobody who can write in root can point the store's writes at another file.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from hicache.backends._io_threads import IOThreads
from hicache.backends._prepared_open import PreparedInThread
from hicache.backends._urls import local_root
from hicache.backends.base import (
    MISS,
    Capabilities,
    ObjectInfo,
    segments_nbytes,
)
from hicache.backends.hf3fs.index import (
    SLOT_HEADER,
    Entry,
    Geometry,
    GeometryMismatchError,
    IndexLog,
    key_hash,
    pack_slot_header,
    slot_header_matches,
)
from hicache.backends.hf3fs.posix import (
    IOItem,
    PosixSlotIO,
    SlotIO,
    check_root,
    open_data_file,
)
from hicache.backends.hf3fs.slots import SlotTable
from hicache.backends.hf3fs.usrbio import UsrbioSlotIO, find_usrbio
from hicache.errors import BackendClosedError, ConfigError

__all__ = ["Hf3fsBackend", "Hf3fsConfig", "Hf3fsMode"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_ALIGN = 4096
_STAGING_ITEMS = 8  # slots per USRBIO staging buffer: a 32-key batch over 4 I/O threads
_ZERO_HEADER = memoryview(bytes(SLOT_HEADER))
_LOOP_WAIT_S = 0.001  # longest an index lookup may hold up the event loop


class Hf3fsMode(enum.Enum):
    AUTO = "auto"  # USRBIO where it can run, else POSIX
    USRBIO = "usrbio"
    POSIX = "posix"


@dataclass(frozen=True, slots=True)
class Hf3fsConfig:
    """Options of ``3fs:///mnt/3fs/kv?rank=0&slots=65536&slot_bytes=2M&mode=usrbio``."""

    root: str  # a directory on the 3FS mount (any directory in POSIX mode); must exist
    rank: int = 0  # one data file and one writer process per rank
    slot_bytes: int = (2 << 20) + 4096  # largest object: a 2 MiB page plus its header
    slots: int = 4096  # capacity of this rank, in objects
    io_threads: int = 4  # a batch is split across this many threads (and USRBIO lanes)
    mode: Hf3fsMode = Hf3fsMode.AUTO
    fsync: bool = False  # sync data before its index record, and the record, on every put
    preallocate: bool = False  # posix_fallocate the data file at open instead of a sparse size

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ConfigError("Hf3fsConfig.root must be a non-empty path")
        if not 0 <= self.rank < 1 << 16:
            raise ConfigError(f"Hf3fsConfig.rank must be in 0..65535, got {self.rank}")
        if not 0 < self.slot_bytes <= 1 << 30:
            raise ConfigError(f"Hf3fsConfig.slot_bytes must be in 1..1G, got {self.slot_bytes}")
        if not 0 < self.slots < 1 << 32:
            raise ConfigError(f"Hf3fsConfig.slots must be in 1..2^32-1, got {self.slots}")
        if self.io_threads <= 0:
            raise ConfigError(f"Hf3fsConfig.io_threads must be positive, got {self.io_threads}")
        object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(self.root)))

    @property
    def stride(self) -> int:
        """Bytes between slot starts: header plus ``slot_bytes``, block-aligned."""
        return -(-(SLOT_HEADER + self.slot_bytes) // _ALIGN) * _ALIGN

    def path(self, suffix: str) -> str:
        return f"{self.root}/hicache-rank{self.rank}.{suffix}"


def _first(segs: Sequence[memoryview], n: int) -> list[memoryview]:
    """The leading views of ``segs`` that hold exactly ``n`` bytes (the caller checked fit)."""
    out: list[memoryview] = []
    for seg in segs:
        if n <= 0:
            break
        out.append(seg[:n] if seg.nbytes > n else seg)
        n -= seg.nbytes
    return out


class Hf3fsBackend(PreparedInThread):
    """Objects in fixed slots of one file per rank, with a durable key-to-slot index."""

    name = "3fs"
    url_schemes = ("hf3fs", "3fs")
    url_parts = frozenset({"host", "path"})  # the host may only be localhost: checked below
    capabilities = Capabilities(persistent=True, shared_across_processes=False, listable=True)
    config_type = Hf3fsConfig

    def __init__(self, config: Hf3fsConfig) -> None:
        super().__init__()
        self.config = config
        self.capabilities = replace(self.capabilities, max_object_bytes=config.slot_bytes)
        self.mode = Hf3fsMode.POSIX  # what open() settled on
        self._stride = config.stride
        geometry = Geometry(config.slot_bytes, config.slots)
        self._table = SlotTable(IndexLog(config.path("index"), geometry, config.fsync))
        self._io: SlotIO | None = None
        self._fd = -1
        self._threads: IOThreads | None = None
        self._io_group = 1  # objects per claim: one syscall each in POSIX mode

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        example = "3fs:///mnt/3fs/hicache"
        return local_root(netloc, path, "3fs", "a mount path (3fs:///mnt/3fs)", example)

    def _prepare(self) -> None:
        """Check root, lock and size the data file, replay the index, start the I/O engine."""
        cfg = self.config
        check_root(cfg.root)
        usrbio = None
        if cfg.mode is not Hf3fsMode.POSIX:
            usrbio = find_usrbio(cfg.root, required=cfg.mode is Hf3fsMode.USRBIO)
        self._fd = open_data_file(cfg.path("data"), cfg.slots * self._stride, cfg.preallocate)
        try:
            self._load_index()
            if usrbio is None:
                self._io = PosixSlotIO(self._fd)
            else:
                lane_bytes = _STAGING_ITEMS * self._stride
                self._io = UsrbioSlotIO(usrbio, self._fd, cfg.io_threads, lane_bytes)
                self.mode = Hf3fsMode.USRBIO
                self._io_group = _STAGING_ITEMS  # a claim fills one lane's staging buffer
        except BaseException:
            self._table.log.close()
            os.close(self._fd)  # releases the lock
            self._fd = -1
            raise
        self._threads = IOThreads(cfg.io_threads, "hicache-3fs")

    def _load_index(self) -> None:
        try:
            found = self._table.load()
        except GeometryMismatchError as exc:
            raise ConfigError(
                f"{self._table.log.path} was written with {exc}: open it with those values, or "
                f"remove it and {self.config.path('data')} to start an empty store"
            ) from None
        if found.corrupt or found.torn_bytes:
            logger.warning(
                "%s: skipped %d damaged records and %d torn bytes; their keys read as misses",
                self._table.log.path,
                found.corrupt,
                found.torn_bytes,
            )

    # ----- backend operations -------------------------------------------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        # The in-memory index is authoritative (this process is the rank's only writer), so
        # this is a lookup on the loop, unless a compaction holds the lock: then in a thread.
        found = self._table.contains(keys, timeout=_LOOP_WAIT_S)
        while found is None:
            found = await asyncio.to_thread(self._table.contains, keys)
        return found

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        return await self._on_lead(self._get_all, keys, buffers)

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        return await self._on_lead(self._put_all, keys, values)

    async def _delete(self, keys: list[str]) -> list[bool]:
        return await self._on_lead(self._delete_all, keys)

    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        return await self._on_lead(self._peek_all, keys, nbytes)

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        # A snapshot: puts and deletes while the caller iterates are safe.
        for key, size, mtime in await asyncio.to_thread(self._table.snapshot, prefix):
            yield ObjectInfo(key, size, mtime)

    async def _stats(self) -> dict[str, int | float]:
        out = self._table.stats()
        out.update(slots=self.config.slots, slot_bytes=self.config.slot_bytes)
        out["usrbio"] = int(self.mode is Hf3fsMode.USRBIO)
        return out

    async def _close(self) -> None:
        if self._threads is not None:
            await asyncio.to_thread(self._threads.shutdown)
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        if self._io is not None:
            self._io.close()
        self._table.log.close()
        self._table.clear()
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1

    async def _on_lead(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one call's job on a lead thread (see ``_io_threads``)."""
        if self._threads is None:
            raise BackendClosedError(f"{type(self).__name__} is closed")
        return await self._threads.call(fn, *args)

    # ----- lead threads: plan, move (spread over the I/O threads), settle --------------------
    def _put_all(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        """Reserve slots, write header and data, publish the records, release dead slots."""
        plans = self._table.reserve([segments_nbytes(segs) for segs in values])
        heads = memoryview(bytearray(SLOT_HEADER * len(keys)))  # one block per object
        ios: list[IOItem] = []
        planned: list[tuple[str, Entry]] = []
        for i, (key, segs, entry) in enumerate(zip(keys, values, plans, strict=True)):
            if entry is not None:
                head = heads[i * SLOT_HEADER : (i + 1) * SLOT_HEADER]
                pack_slot_header(head, entry.seq, entry.size, key_hash(key))
                ios.append((entry.slot * self._stride, [head, *segs]))
                planned.append((key, entry))
        done: list[tuple[str, Entry]] = []
        lost: list[int] = []
        for (key, entry), got in zip(planned, self._io_call(True, ios), strict=True):
            if got == SLOT_HEADER + entry.size:
                done.append((key, entry))
            else:
                lost.append(entry.slot)
                self._table.count("put_errors", f"write of {key!r} failed ({got})")
        self._staged(sum(entry.size for _, entry in done))
        if done and self.config.fsync and not self._sync_data():
            lost.extend(entry.slot for _, entry in done)
            done = []
        dead = self._table.publish(done) if done else []
        if dead is None:  # the log failed: these puts did not happen
            lost.extend(entry.slot for _, entry in done)
            done, dead = [], []
        self._table.free(lost)  # never published: no record names these slots
        self._release(dead)
        stored = {key for key, _ in done}
        return [key in stored for key in keys]

    def _sync_data(self) -> bool:
        """Make written data durable before any record points at it; False if that failed."""
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._table.count("put_errors", f"syncing the data file failed: {exc}")
            return False
        return True

    def _get_all(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        entries = self._table.pin(keys, touch=True)
        try:
            targets = [
                None if e is None or e.size > segments_nbytes(segs) else _first(segs, e.size)
                for segs, e in zip(buffers, entries, strict=True)
            ]
            got = self._read(keys, entries, targets)
        finally:
            self._release(self._table.unpin(entries))
        # An object too large for its buffer reports its size, unread.
        return [
            e.size if e is not None and t is None else n
            for n, t, e in zip(got, targets, entries, strict=True)
        ]

    def _peek_all(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        entries = self._table.pin(keys, touch=False)  # tools reading headers keep the LRU order
        bufs = [None if e is None else bytearray(min(nbytes, e.size)) for e in entries]
        try:
            got = self._read(keys, entries, [None if b is None else [memoryview(b)] for b in bufs])
        finally:
            self._release(self._table.unpin(entries))
        return [None if b is None or n < 0 else bytes(b) for b, n in zip(bufs, got, strict=True)]

    def _read(
        self, keys: list[str], entries: list[Entry | None], targets: list[list[memoryview] | None]
    ) -> list[int]:
        """Read each targeted object with its slot header in front; its size, or MISS."""
        results = [MISS] * len(keys)
        heads = memoryview(bytearray(SLOT_HEADER * len(keys)))
        ios: list[IOItem] = []
        which: list[tuple[int, Entry, memoryview]] = []  # (item, entry, its header block)
        for i, (entry, segs) in enumerate(zip(entries, targets, strict=True)):
            if entry is not None and segs is not None:
                head = heads[i * SLOT_HEADER : (i + 1) * SLOT_HEADER]
                ios.append((entry.slot * self._stride, [head, *segs]))
                which.append((i, entry, head))
        for (i, entry, head), (_, io), got in zip(
            which, ios, self._io_call(False, ios), strict=True
        ):
            if got != segments_nbytes(io):
                self._table.count("read_errors", f"read of {keys[i]!r} failed ({got})")
            elif not slot_header_matches(head, entry.seq, entry.size, key_hash(keys[i])):
                self._table.count("slot_mismatches", f"slot of {keys[i]!r} holds other data")
                self._table.forget(keys[i], entry)
            else:
                results[i] = entry.size
                self._staged(got - SLOT_HEADER)  # a peek reads less than the object
        return results

    def _staged(self, nbytes: int) -> None:
        """Count object bytes that went through a USRBIO lane (POSIX mode copies none)."""
        if self.mode is Hf3fsMode.USRBIO and nbytes:
            self._table.add("bytes_staged", nbytes)

    def _delete_all(self, keys: list[str]) -> list[bool]:
        found, dead = self._table.delete(keys)
        self._release(dead)
        return found

    def _release(self, slots: list[int]) -> None:
        """Zero dead slots' headers, then free them (a failed zeroing is only counted: any
        record still naming the slot is already superseded in the log)."""
        if not slots:
            return
        zeros: list[IOItem] = [(slot * self._stride, [_ZERO_HEADER]) for slot in slots]
        # On this thread: small writes, cheaper than waking the workers for them.
        for slot, got in zip(slots, self._io_call(True, zeros, spread=False), strict=True):
            if got != SLOT_HEADER:
                self._table.count("put_errors", f"zeroing slot {slot} failed ({got})")
        self._table.free(slots)

    def _io_call(self, write: bool, ios: list[IOItem], spread: bool = True) -> list[int]:
        """Move ``ios``, shared out over the I/O threads unless ``spread`` is False."""
        if not ios:
            return []
        assert self._io is not None and self._threads is not None  # set by open()
        move = self._io.write if write else self._io.read
        return self._threads.spread(move, ios, self._io_group) if spread else move(ios)
