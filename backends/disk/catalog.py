"""What one process knows of a ``disk`` store: the index, and how far it has read each log.

Opening loads the newest snapshot, then reads every slot's log from the point the snapshot
covers (or from ``FIRST_GENERATION``, for a slot the snapshot does not know), then drops the
entries whose segment file is gone. Afterwards :meth:`Catalog.refresh` reads what other
processes appended since: it is called on a miss, so a page another process stored before the
miss is found, and at least every ``REFRESH_S`` seconds by the busy paths.

A generation this process had not read yet may be gone when it looks: a writer's snapshot
(at close, or every ``snapshot_records``) removes the generations it covers. The tail then
finds its generation missing, and the index is rebuilt from the snapshot that covers it.

Snapshots: :meth:`Catalog.capture` and :func:`write_snapshot`; the writer decides when.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import stat
import threading
import time

from hicache.backends._open_flags import NOFOLLOW
from hicache.backends.disk.format import (
    LOG_HEADER,
    LogOp,
    LogRecord,
    Snapshot,
    decode_snapshot,
    encode_snapshot,
)
from hicache.backends.disk.index import KeyIndex
from hicache.backends.disk.layout import StoreDirs
from hicache.backends.disk.logs import FIRST_GENERATION, LogTail, list_generations
from hicache.backends.disk.segments import SegmentFiles, list_segments

__all__ = ["REFRESH_S", "Catalog", "write_snapshot"]

logger = logging.getLogger(__name__)

REFRESH_S = 0.5
SNAPSHOT = "snapshot"
_OPEN_TRIES = 5  # a snapshot replaced while this process read the logs it names: read again


class Catalog:
    def __init__(self, dirs: StoreDirs, own_slot: int | None, direct: bool = False) -> None:
        self.dirs = dirs
        self.own_slot = own_slot
        self.index = KeyIndex()
        self.lock = threading.Lock()  # the index and the tails
        self.tails: dict[int, LogTail] = {}
        self.files = SegmentFiles(dirs.segments, direct)
        self.last_refresh = 0.0
        self.rebuild_due = False  # a refresh found records lost to it: see refresh(rebuild)
        self.own_generation = 0  # where the replay of this process's slot ended (see load)
        # The snapshot file last read or written here (its identity) and the log points it
        # covers: a writer about to snapshot decodes the file again only if it was replaced.
        self.known_snapshot: tuple[SnapshotId | None, dict[int, tuple[int, int]] | None] = (
            None,
            None,
        )
        self.counts = {"log_gaps": 0, "snapshot_damaged": 0, "lost_segments": 0}
        self._warned: set[str] = set()

    # ----- opening ------------------------------------------------------------------------
    def load(self) -> None:
        """Build the index from the snapshot and the logs (blocking). Also rebuilds it when a
        refresh found a log generation gone (see :meth:`refresh`)."""
        damaged = self.counts["snapshot_damaged"]
        for attempt in range(_OPEN_TRIES):
            last = attempt == _OPEN_TRIES - 1  # snapshots kept changing: the logs as they are
            self.counts["snapshot_damaged"] = damaged  # once a load, not once an attempt
            snap = self._read_snapshot()
            tails = self._start_tails(snap, give_up=last)
            if tails is None:
                continue
            index = KeyIndex()
            if snap is not None:
                index.load(snap)
            for tail in self.tails.values():  # a rebuild's, or the previous attempt's
                tail.close()
            self.index, self.tails = index, tails
            gaps: list[str] = []
            for tail in tails.values():
                self._apply(tail.read(gaps.append))
            # A generation removed between reading the snapshot and opening it was covered by
            # a newer snapshot: read again. Gaps that stay are damage (counted, misses).
            newer = snapshot_identity(self.dirs.index) != self.known_snapshot[0]
            if not gaps or last or not newer:
                for message in gaps:
                    self._gap(message)
                break
        present = set(list_segments(self.dirs.segments))
        self.counts["lost_segments"] += self.index.keep_segments(present)
        if self.own_slot is not None:  # this process appends its own records itself
            own = self.tails.pop(self.own_slot, None)
            if own is not None:
                own.close()
                self.own_generation = own.generation
        self.last_refresh = time.monotonic()

    def _read_snapshot(self) -> Snapshot | None:
        identity = snapshot_identity(self.dirs.index)
        try:
            fd = os.open(SNAPSHOT, os.O_RDONLY | NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dirs.index)
        except FileNotFoundError:
            self.known_snapshot = (identity, None)
            return None
        except OSError:  # a link (O_NOFOLLOW: ELOOP), no permission: as damaged, not a crash
            fd = -1
        data = b""
        if fd >= 0:
            try:
                with os.fdopen(fd, "rb") as f:
                    data = f.read()
            except OSError:  # a directory named snapshot, an I/O error
                data = b""
        snap = decode_snapshot(data)
        self.known_snapshot = (identity, None if snap is None else snap.logs)
        if snap is None:
            self.counts["snapshot_damaged"] += 1
            self._warn("snapshot", "the index snapshot is damaged: the logs are read instead")
        return snap

    def _start_tails(
        self, snap: Snapshot | None, give_up: bool = False
    ) -> dict[int, LogTail] | None:
        """A tail per slot at the point the snapshot covers (a slot it does not cover: from
        its first generation, which a newer snapshot may have removed: a gap, and the load
        reads again); None when a generation the snapshot names is gone while a later one
        exists (a newer snapshot replaced it)."""
        gens = list_generations(self.dirs.index)
        covered = snap.logs if snap is not None else {}
        tails: dict[int, LogTail] = {}
        for slot in sorted(set(gens) | set(covered)):
            have = gens.get(slot, [])
            gen, off = covered.get(slot, (FIRST_GENERATION, LOG_HEADER))
            if have and gen not in have and not give_up and any(g > gen for g in have):
                return None
            tails[slot] = LogTail(self.dirs.index, slot, gen, off)
        return tails

    # ----- keeping up -----------------------------------------------------------------------
    def refresh(self, rebuild: bool = True) -> bool:
        """Apply what other processes appended to their logs since the last look (blocking).

        When a generation was removed before this process read it, the index is rebuilt from
        the snapshot that covers it (:meth:`load`): with ``rebuild=False`` that is left to the
        next call that allows it, and the result is False (the index is not up to date)."""
        with self.lock:
            if not self.rebuild_due:
                self.rebuild_due = self._read_logs()
            if self.rebuild_due:
                if not rebuild:
                    return False
                self.load()
                self.rebuild_due = False
            self.last_refresh = time.monotonic()
            return True

    def _read_logs(self) -> bool:
        """Apply the records appended since the last look; True when some were lost here: a
        generation removed before a tail read it (a slot new to this process whose first
        generation is gone, or one a ROTATE named before it was created). The snapshot that
        removed it covers its records."""
        # A new slot's tail starts at its first generation, not at the oldest one present: a
        # writer that snapshotted (every close does) removed the older ones, and a tail begun
        # past them never saw their records (a writer's last pages were hidden from every
        # process that had not looked before it closed).
        for slot, gens in list_generations(self.dirs.index).items():
            if slot not in self.tails and slot != self.own_slot and gens:
                self.tails[slot] = LogTail(self.dirs.index, slot, FIRST_GENERATION, LOG_HEADER)
        gaps: list[str] = []
        for tail in self.tails.values():
            self._apply(tail.read(gaps.append))
        return bool(gaps)

    def stale(self) -> bool:
        return time.monotonic() - self.last_refresh > REFRESH_S

    def _apply(self, records: list[LogRecord]) -> None:
        index = self.index
        for rec in records:
            index.apply(rec)
            if rec.op is LogOp.RECLAIM:
                self.files.forget(rec.segment)

    def positions(self) -> dict[int, tuple[int, int]]:
        return {slot: (t.generation, t.offset) for slot, t in self.tails.items()}

    def _gap(self, message: str) -> None:
        self.counts["log_gaps"] += 1
        self._warn("gap", message + ": the objects it indexed read as misses")

    def _warn(self, kind: str, message: str) -> None:
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        logger.log(level, "%s (store %s)", message, self.dirs.root)

    def close(self) -> None:
        for tail in self.tails.values():
            tail.close()
        self.tails.clear()
        self.files.close()


SnapshotId = tuple[int, int, int]  # inode, mtime (ns), size: a rename changes it


def snapshot_identity(index_fd: int) -> SnapshotId | None:
    """Which file the snapshot is now (None: there is none, or it is no regular file)."""
    try:
        st = os.stat(SNAPSHOT, dir_fd=index_fd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if stat.S_ISREG(st.st_mode) else None


def snapshot_positions(catalog: Catalog) -> dict[int, tuple[int, int]] | None:
    """The log points the current snapshot covers, or None when there is none to read. Decoded
    again only when another process replaced the snapshot this process last read or wrote."""
    identity = snapshot_identity(catalog.dirs.index)
    if identity is not None and identity == catalog.known_snapshot[0]:
        return catalog.known_snapshot[1]
    try:
        fd = os.open(SNAPSHOT, os.O_RDONLY | NOFOLLOW | os.O_CLOEXEC, dir_fd=catalog.dirs.index)
        with os.fdopen(fd, "rb") as f:
            snap = decode_snapshot(f.read())
    except OSError:  # none, or a link or directory planted there: replaced by the next one
        return None
    return None if snap is None else snap.logs


@contextlib.contextmanager
def snapshot_lock(index_fd: int):  # type: ignore[no-untyped-def]
    """The store's snapshot lock if free (yields True), else yields False at once."""
    fd = os.open("snapshot.lock", os.O_RDWR | os.O_CREAT | NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=index_fd)  # fmt: skip
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def write_snapshot(catalog: Catalog, snap: Snapshot, fsync: bool) -> None:
    """Replace the store's snapshot with ``snap`` atomically (a temporary file, then rename)."""
    index_fd = catalog.dirs.index
    tmp = f".{SNAPSHOT}.{os.getpid()}.{random.getrandbits(32):08x}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=index_fd)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            for chunk in encode_snapshot(snap):
                f.write(chunk)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, SNAPSHOT, src_dir_fd=index_fd, dst_dir_fd=index_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=index_fd)
        raise
    if fsync:
        os.fsync(index_fd)
    catalog.known_snapshot = (snapshot_identity(index_fd), dict(snap.logs))
