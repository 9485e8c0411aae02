"""``disk://``: a log-structured local store (large append-only segments, an index in memory).

One file per page costs a create, a write, a rename and a close per put, and a scan of every
file at open. This store appends objects to large segment files instead and keeps the key ->
(segment, offset, length, sequence) index in memory, persisted as append-only logs plus
snapshots (:mod:`.format` has the formats, :mod:`.layout` the directory):

- **Puts** of a batch are one ``pwritev`` from the callers' buffers, then one log append
  (:mod:`.writer`). **Reads** go straight into the callers' buffers, back-to-back records in
  one ``preadv``, each checked against its index entry and its payload's xxh3 (:mod:`.reads`):
  a damaged, stale or foreign record is a miss, and forgotten.
- **exists / leading_hits** are lookups in the index: no system call while keys are found.
- **Several processes** open one directory at once: each writer takes a slot (a lock file) and
  appends to segments and a log of its own; a process reads the others' logs on a miss and at
  least every half second (:mod:`.catalog`), so a page another process stored before the miss
  is found. A reader holding a segment that gets reclaimed reads its old bytes or a miss.
- **Crashes**: data is written before the log names it, logs end at their last whole record,
  and a reader checks every record, so after ``kill -9`` anywhere an indexed object reads
  byte-exact or as a miss. ``fsync=true`` syncs data and log before a put returns.
- **Capacity**: whole segments are reclaimed, least recently used first, hot objects appended
  anew first (:mod:`.reclaim`); ``delete`` marks objects dead in the log.

``read_only=true`` opens an existing store and writes nothing (the tools' reads).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from hicache.backends._io_threads import IOThreads, in_thread
from hicache.backends._prepared_open import PreparedInThread
from hicache.backends._urls import local_root
from hicache.backends.base import (
    MISS,
    Capabilities,
    ObjectInfo,
    segments_nbytes,
)
from hicache.backends.disk.audit import DamagedRegion, audit_segments
from hicache.backends.disk.catalog import Catalog
from hicache.backends.disk.config import DiskConfig
from hicache.backends.disk.format import (
    LARGE_RECORD_BYTES,
    MAX_GAP,
    RECORD_HEADER,
    LogOp,
    encode_log_frame,
    parse_record_header,
)
from hicache.backends.disk.index import Entry
from hicache.backends.disk.layout import StoreDirs, claim_slot, open_store_dirs
from hicache.backends.disk.reads import NOWAIT, ReadItem, read_records, read_spread, trim
from hicache.backends.disk.reclaim import Reclaimer
from hicache.backends.disk.segments import list_segments
from hicache.backends.disk.writer import Appender
from hicache.errors import ReadOnlyStoreError

__all__ = ["DiskBackend", "DiskConfig"]

logger = logging.getLogger(__name__)
_INLINE_STALL_S = 0.002  # an inline put that took longer was made to wait by the kernel
_INLINE_BACKOFF_S = 5.0


class DiskBackend(PreparedInThread):
    name = "disk"
    url_schemes = ("disk",)
    url_parts = frozenset({"host", "path"})  # the host may only be localhost
    capabilities = Capabilities(
        persistent=True,
        shared_across_processes=True,
        zero_copy=False,
        listable=True,
        checks_pages_over=LARGE_RECORD_BYTES,  # reads.py: a large record's page sum as it reads
    )
    config_type = DiskConfig

    def __init__(self, config: DiskConfig) -> None:
        super().__init__()
        self.config = config
        self._dirs: StoreDirs | None = None
        self._catalog: Catalog | None = None
        self._appender: Appender | None = None
        self._reclaimer: Reclaimer | None = None
        self._append_lock = threading.Lock()  # appends, deletes, reclaims of this process
        self._n = dict.fromkeys(("bad_records", "refreshes", "inline_stalls"), 0)
        self._inline_after = 0.0  # puts stay off the loop until then (see _put)
        # Large batches are read by several threads (reads.PARALLEL_BYTES).
        self._io = IOThreads(config.threads, "hicache-disk") if config.threads > 1 else None
        self.open_s = 0.0

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        return local_root(
            netloc, path, "disk", "a local path (disk:///abs/path)", "disk:///var/cache/kv"
        )

    def _prepare(self) -> None:
        start = time.perf_counter()
        dirs = open_store_dirs(self.config)
        lock_fd = -1
        try:
            slot, lock_fd = (
                (None, -1) if self.config.read_only else claim_slot(dirs, self.config.max_writers)
            )
            catalog = Catalog(dirs, slot, self.config.direct)
            catalog.load()
            if slot is not None:
                spread = self._io.spread if self._io is not None else None
                self._appender = Appender(catalog, self.config, slot, lock_fd, spread)
                self._reclaimer = Reclaimer(
                    catalog, self._appender, self.config.capacity, self.config.reinsert
                )
        except BaseException:
            if lock_fd >= 0 and self._appender is None:  # the slot, claimed but not taken on
                os.close(lock_fd)
            dirs.close()
            if self._io is not None:
                self._io.shutdown()
            raise
        self._dirs, self._catalog = dirs, catalog
        if self._appender is not None:
            largest = self._appender.max_object_bytes
            self.capabilities = replace(self.capabilities, max_object_bytes=largest)
        self.open_s = time.perf_counter() - start

    @property
    def catalog(self) -> Catalog:
        assert self._catalog is not None, "open() first"
        return self._catalog

    # ----- lookups ------------------------------------------------------------------------
    async def _exists(self, keys: list[str]) -> list[bool]:
        catalog = self.catalog
        found = [k in catalog.index for k in keys]  # a dict lookup each: atomic under the GIL
        if not all(found) or catalog.stale():
            await self._refresh()
            found = [k in catalog.index for k in keys]
        return found

    async def _refresh(self) -> None:
        catalog = self.catalog
        self._n["refreshes"] += 1
        if catalog.lock.acquire(blocking=False):  # usually free: read the logs right here
            catalog.lock.release()
            if catalog.refresh(rebuild=False):
                return
        # A snapshot or a long put holds the lock, or the index is to be rebuilt from the
        # snapshot (a million entries take a second): in a thread, not on the loop.
        await in_thread(catalog.refresh)

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        """A first pass on the loop for what the page cache holds (no thread hop), the rest
        in a worker thread (see :mod:`.reads`); a miss, or a busy index, goes to the thread
        whole, where it may wait for the lock and read the other processes' logs."""
        catalog = self.catalog
        direct = self.config.direct  # O_DIRECT reads wait for the device: never on the loop
        if not NOWAIT or direct or catalog.stale() or not catalog.lock.acquire(blocking=False):
            return await in_thread(self._read, keys, buffers)
        try:
            entries = [catalog.index.get(k) for k in keys]
        finally:
            catalog.lock.release()
        # A miss, or more than a small batch of bytes (a copy of them would hold the loop):
        # the whole read in a thread.
        nbytes = sum(e[2] if e is not None else 0 for e in entries)
        if None in entries or nbytes > self.config.inline_bytes:
            return await in_thread(self._read, keys, buffers)
        results, items, where = _plan(entries, keys, buffers)
        got, bad, later = read_records(catalog.files, items, NOWAIT)
        if later:
            again, bad_again = await in_thread(
                read_spread, catalog.files, [items[j] for j in later], self._io
            )
            for j, n in zip(later, again, strict=True):
                got[j] = n
            bad.extend(later[j] for j in bad_again)
        if bad:
            await in_thread(self._forget_bad, [items[j] for j in bad])
        self._settle(items, where, got, results)
        return results

    def _read(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        """The whole read in a worker thread (blocking)."""
        catalog = self.catalog
        with catalog.lock:
            entries = [catalog.index.get(k) for k in keys]
        if None in entries or catalog.stale():
            catalog.refresh()
            with catalog.lock:
                entries = [catalog.index.get(k) for k in keys]
        results, items, where = _plan(entries, keys, buffers)
        got, bad = read_spread(catalog.files, items, self._io)
        if bad:
            self._forget_bad([items[j] for j in bad])
        self._settle(items, where, got, results)
        return results

    def _settle(
        self, items: list[ReadItem], where: list[int], got: list[int], results: list[int]
    ) -> None:
        """Each read's outcome into ``results``; the hits' keys noted as recently read."""
        for i, n in zip(where, got, strict=True):
            results[i] = n
        if self._reclaimer is None:
            return
        hits = [items[j] for j, n in enumerate(got) if n >= 0]
        # Recency is a hint: when a put holds the lock, these reads go unnoted.
        if hits and self.catalog.lock.acquire(blocking=False):
            try:
                self._reclaimer.note_reads([h[0] for h in hits], [h[1][0] for h in hits])
            finally:
                self.catalog.lock.release()

    def _forget_bad(self, items: list[ReadItem]) -> None:
        """Records that failed their checks: out of the index here, and out of every other
        process's through a DELETE at the bad entry's sequence (a newer put survives it)."""
        catalog = self.catalog
        with catalog.lock:
            for key, (code, offset, _, _), _ in items:
                catalog.index.remove_if_at(key, code, offset)
            self._n["bad_records"] += len(items)
        logger.warning("disk store %s: %d records failed their checks (read as misses)",
                       catalog.dirs.root, len(items))  # fmt: skip
        if self._appender is not None:
            data = encode_log_frame([(LogOp.DELETE, key, e[3], 0, 0, 0) for key, e, _ in items])
            try:
                with self._append_lock:
                    self._appender.log.append(data)
            except OSError as exc:  # a full disk: the others find the bad records themselves
                logger.warning("disk store %s: cannot log the damaged records: %s",
                               catalog.dirs.root, exc)  # fmt: skip

    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        return await in_thread(self._peek_sync, keys, nbytes)

    def _peek_sync(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        catalog = self.catalog
        out: list[bytes | None] = []
        for key in keys:
            with catalog.lock:
                entry = catalog.index.get(key)
            fd = catalog.files.fd(entry[0]) if entry is not None else None
            if entry is None or fd is None:
                out.append(None)
                continue
            kb = key.encode("ascii")
            want = min(nbytes, entry[2])
            body = RECORD_HEADER + len(kb)
            try:  # the most a gap can add read too (format.py): one read whatever the gap
                data = os.pread(fd, body + MAX_GAP + want, entry[1])
            except OSError:
                data = b""
            h = parse_record_header(data, kb)
            ok = h is not None and h.length == entry[2] and h.seq == entry[3]
            start = body + (h.gap if h is not None else 0)
            out.append(data[start : start + want] if ok and len(data) >= start + want else None)
        return out

    async def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        await in_thread(self.catalog.refresh)
        entries = await in_thread(self._listing, prefix)
        for key, length, seq in entries:
            yield ObjectInfo(key, length, seq / 1e9)

    def _listing(self, prefix: str) -> list[tuple[str, int, int]]:
        with self.catalog.lock:
            return [(k, e[2], e[3]) for k, e in self.catalog.index.items(prefix)]

    # ----- writes -------------------------------------------------------------------------
    def _writer(self, what: str) -> Appender:
        if self._appender is None:
            raise ReadOnlyStoreError(
                f"{what} refused: the disk store at {self.config.root} was opened read-only"
            )
        return self._appender

    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        appender = self._writer("put")
        if self._inline_put_allowed(keys, values):
            try:
                start = time.perf_counter()
                return appender.put(keys, values)
            finally:
                self._append_lock.release()
                if time.perf_counter() - start > _INLINE_STALL_S:
                    # The kernel made this write wait (dirty-page throttling, a full queue):
                    # puts leave the loop for a while, so the next wait is a thread's.
                    self._inline_after = time.monotonic() + _INLINE_BACKOFF_S
                    self._n["inline_stalls"] += 1
        return await in_thread(self._locked, appender.put, keys, values)

    def _inline_put_allowed(self, keys: list[str], values: list[list[memoryview]]) -> bool:
        """Whether this put may run right here on the loop, and if so, the append lock taken.

        A small batch written into the page cache costs less than the hop to a thread and
        back (about 50 us of CPU here, a third of a 32-page batch of 4 KiB): so a put runs
        inline when it is at most ``inline_bytes``, needs no fsync, no reclaim, no snapshot
        and no look at other processes' logs, and the lock is free this instant.
        """
        appender, reclaimer = self._appender, self._reclaimer
        assert appender is not None and reclaimer is not None
        if self.config.fsync or self.config.direct or self.catalog.stale():
            return False
        if time.monotonic() < self._inline_after:
            return False
        if appender.log.records_since_rotate + len(keys) >= self.config.snapshot_records:
            return False
        nbytes = sum(s.nbytes for segs in values for s in segs)
        if nbytes > self.config.inline_bytes or not reclaimer.fits(nbytes + 512 * len(keys)):
            return False
        return self._append_lock.acquire(blocking=False)

    async def _delete(self, keys: list[str]) -> list[bool]:
        appender = self._writer("delete")
        await self._refresh()
        return await in_thread(self._locked, appender.delete, keys)

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._append_lock:
            if self.catalog.stale():
                self.catalog.refresh()
            return fn(*args)

    async def compact_segments(self, min_dead: float = 0.5) -> tuple[int, int]:
        """Move the live records out of segments at least ``min_dead`` dead (deleted or
        overwritten) and reclaim them; (segments reclaimed, bytes freed)."""
        self._check_open()
        self._writer("compaction")
        assert self._reclaimer is not None
        return await in_thread(self._locked, self._reclaimer.compact, min_dead)

    async def audit_segments(self) -> list[DamagedRegion]:
        """Walk every segment and report each stretch that does not check out, with the
        objects it lost (for ``hicache verify``)."""
        self._check_open()
        await in_thread(self.catalog.refresh)
        return await in_thread(audit_segments, self.catalog)

    # ----- stats and close ----------------------------------------------------------------
    async def _stats(self) -> dict[str, int | float]:
        catalog = self.catalog
        segments = await asyncio.to_thread(list_segments, catalog.dirs.segments)
        with catalog.lock:
            out: dict[str, int | float] = {
                "objects": len(catalog.index),
                "used_bytes": catalog.index.used_bytes,
                **self._n,
                **catalog.counts,
            }
        out["segments"] = len(segments)
        out["disk_bytes"] = sum(st.st_size for st in segments.values())
        out["capacity"] = self.config.capacity or 0
        out["open_s"] = round(self.open_s, 6)
        for part in (self._appender, self._reclaimer):
            if part is not None:
                out.update(part.counts)
        writes_staged = self._appender.counts["bytes_staged"] if self._appender else 0
        out["bytes_staged"] = writes_staged + catalog.files.bytes_staged  # direct=true only
        return out

    async def _close(self) -> None:
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        try:
            if self._appender is not None:
                with self._append_lock:
                    try:
                        self._appender.seal()
                        self._appender.maybe_snapshot(force=True)  # a fast next open
                    except OSError as exc:
                        logger.warning(
                            "disk store %s: no snapshot at close: %s", self.config.root, exc
                        )
                    self._appender.close()
        finally:
            if self._io is not None:
                self._io.shutdown()
            if self._catalog is not None:
                self._catalog.close()
            if self._dirs is not None:
                self._dirs.close()


def _plan(
    entries: list[Entry | None], keys: list[str], buffers: list[list[memoryview]]
) -> tuple[list[int], list[ReadItem], list[int]]:
    """Results with the misses and too-small buffers filled in; the reads to make and, for
    each, its position in the batch."""
    results = [MISS] * len(keys)
    items: list[ReadItem] = []
    where: list[int] = []
    for i, entry in enumerate(entries):
        if entry is None:
            continue
        segs = buffers[i]
        if entry[2] > segments_nbytes(segs):
            results[i] = entry[2]  # too small: the size, nothing read
            continue
        items.append((keys[i], entry, trim(segs, entry[2])))
        where.append(i)
    return results, items, where
