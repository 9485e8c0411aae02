"""The ``disk`` backend's index logs: one writer's appends, every process's tails.

Each writer slot ``N`` appends to ``index/wNNN.GGGGGGGG.log``, one generation at a time,
starting at :data:`FIRST_GENERATION`. A generation ends with a ROTATE record naming the next
one, appended before the next file is created, so a reader that follows the chain from any
point of any generation sees every record in order and never skips a file; a reader that
finds the named file missing yet waits (its writer is creating it) until the next look.

A snapshot removes the generations it covers, so a slot's oldest generation present is not
where its records begin: a reader new to a slot starts at :data:`FIRST_GENERATION` (or where
the snapshot it read covers the slot), and finds it missing when a snapshot covers it.

Gaps (a generation deleted or damaged by hand) are stepped over to the next generation that
exists, and counted: the entries recorded there are lost, which reads as misses.

All I/O goes through directory descriptors with ``O_NOFOLLOW``: no link below the store's root
is ever followed.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from hicache.backends._open_flags import CLOEXEC, NOFOLLOW
from hicache.backends.disk.format import (
    LOG_HEADER,
    LogOp,
    LogRecord,
    decode_log,
    encode_log_record,
    log_header,
    parse_log_header,
)

__all__ = ["FIRST_GENERATION", "LogTail", "LogWriter", "list_generations", "log_name"]

_NAME = re.compile(r"w(\d{3})\.([0-9a-f]{8})\.log\Z")
FIRST_GENERATION = 1  # a new slot's (recover, with nothing replayed: 0 + 1)


def log_name(slot: int, generation: int) -> str:
    return f"w{slot:03d}.{generation:08x}.log"


def list_generations(dir_fd: int) -> dict[int, list[int]]:
    """Every slot's log generations present in the index directory, ascending."""
    out: dict[int, list[int]] = {}
    for name in os.listdir(dir_fd):
        m = _NAME.match(name)
        if m:
            out.setdefault(int(m.group(1)), []).append(int(m.group(2), 16))
    for gens in out.values():
        gens.sort()
    return out


def _open_log(dir_fd: int, slot: int, generation: int, mode: int = os.O_RDONLY) -> int | None:
    """A generation's file, open in ``mode``, once its header checks; None otherwise."""
    try:
        fd = os.open(log_name(slot, generation), mode | NOFOLLOW | CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    if parse_log_header(os.pread(fd, LOG_HEADER, 0)) != (slot, generation):
        os.close(fd)
        return None
    return fd


@dataclass(slots=True)
class LogTail:
    """Where one slot's log has been read to; :meth:`read` returns what came since."""

    dir_fd: int
    slot: int
    generation: int
    offset: int
    fd: int | None = None
    gaps: int = 0  # generations found missing or damaged and stepped over

    def read(self, on_gap: Callable[[str], None] | None = None) -> list[LogRecord]:
        """The records appended since the last read, following ROTATE records."""
        out: list[LogRecord] = []
        while True:
            if self.fd is None and not self._open_current(on_gap):
                return out
            assert self.fd is not None
            size = os.fstat(self.fd).st_size
            if size <= self.offset:
                return out
            data = os.pread(self.fd, size - self.offset, self.offset)
            records, used = decode_log(data)
            self.offset += used
            out.extend(records)
            if not records or records[-1].op is not LogOp.ROTATE:
                return out
            os.close(self.fd)
            self.fd = None
            self.generation, self.offset = records[-1].segment, LOG_HEADER

    def _open_current(self, on_gap: Callable[[str], None] | None) -> bool:
        self.fd = _open_log(self.dir_fd, self.slot, self.generation)
        if self.fd is not None:
            return True
        later = [g for g in list_generations(self.dir_fd).get(self.slot, []) if g > self.generation]
        if not later:
            return False  # not created yet (a ROTATE just named it), or nothing was ever written
        if on_gap is not None:
            on_gap(f"index log {log_name(self.slot, self.generation)} is missing or damaged")
        self.gaps += 1
        self.generation, self.offset = later[0], LOG_HEADER
        return self._open_current(on_gap)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class LogWriter:
    """The appends of the slot this process holds (its lock taken by the caller)."""

    def __init__(self, dir_fd: int, slot: int, fsync: bool) -> None:
        self.dir_fd = dir_fd
        self.slot = slot
        self.fsync = fsync
        self.generation = 0
        self.records_since_rotate = 0
        self._fd = -1
        self._end = 0  # the size of the open generation: only this process appends to it

    def recover(self, replayed: int = 0) -> None:
        """Take over the slot's log after whoever held it: its torn tail cut, a new generation
        started (the old one ended with a ROTATE naming it). ``replayed``: the generation the
        replay of this slot ended in (a snapshot may name one whose file is gone)."""
        gens = list_generations(self.dir_fd).get(self.slot, [])
        if not gens or gens[-1] < replayed:
            # No log, or none as far as the snapshot names (deleted by hand): start past that
            # generation, where readers waiting for it step over to (restarting at 1 hid
            # every later record from them until they reopened).
            self._create(replayed + 1)
            return
        last = gens[-1]
        fd = _open_append(self.dir_fd, self.slot, last)
        if fd is None:  # damaged beyond its header: readers step over it
            self._create(last + 1)
            return
        try:
            size = os.fstat(fd).st_size
            records, used = decode_log(os.pread(fd, size - LOG_HEADER, LOG_HEADER))
            if LOG_HEADER + used < size:
                os.ftruncate(fd, LOG_HEADER + used)
            self._end = LOG_HEADER + used
            os.lseek(fd, 0, os.SEEK_END)
            if records and records[-1].op is LogOp.ROTATE:
                nxt = records[-1].segment  # the crash came between the ROTATE and the create
            else:
                nxt = last + 1
                _write_all(fd, encode_log_record(LogOp.ROTATE, "", 0, nxt, 0, 0))
        finally:
            os.close(fd)
        self._create(nxt)

    def append(self, data: bytes) -> None:
        if self._fd < 0 and self._end == -1:  # a rotate could not create the generation its
            self._create(self.generation)  # ROTATE names (a full disk): try again
        try:
            _write_all(self._fd, data)
        except OSError:
            # A record cut short (ENOSPC half way) would end every replay of this log there,
            # hiding all the records appended after it: cut it off (truncating frees space).
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
            raise
        self._end += len(data)
        if self.fsync:
            os.fsync(self._fd)

    def rotate(self) -> int:
        """Continue in a new generation; its number."""
        nxt = self.generation + 1
        self.append(encode_log_record(LogOp.ROTATE, "", 0, nxt, 0, 0))
        os.close(self._fd)
        # From here appends go to ``nxt``, which the ROTATE names; when its creation fails
        # (a full disk) the next append creates it, rather than writing to a closed descriptor.
        self._fd, self.generation, self._end = -1, nxt, -1  # -1: to be created (see append)
        self._create(nxt)
        return nxt

    def remove_before(self, generation: int) -> None:
        """Delete this slot's generations older than ``generation`` (a snapshot covers them)."""
        for gen in list_generations(self.dir_fd).get(self.slot, []):
            if gen < generation:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(log_name(self.slot, gen), dir_fd=self.dir_fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _create(self, generation: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | NOFOLLOW | CLOEXEC
        fd = os.open(log_name(self.slot, generation), flags, 0o600, dir_fd=self.dir_fd)
        try:
            _write_all(fd, log_header(self.slot, generation))
            if self.fsync:
                os.fsync(fd)
                os.fsync(self.dir_fd)
        except OSError:
            os.close(fd)  # left with no header: readers wait, and the next try truncates it
            raise
        self._fd, self.generation, self.records_since_rotate = fd, generation, 0
        self._end = LOG_HEADER


def _open_append(dir_fd: int, slot: int, generation: int) -> int | None:
    return _open_log(dir_fd, slot, generation, os.O_RDWR)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
