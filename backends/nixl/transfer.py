"""Planning and running the NIXL transfers of one batch of objects (worker threads only).

An object moves straight from or to the caller's segments when they lie inside memory
registered with the agent (the zero-copy path a host pool gets by registering its buffer once);
otherwise through the staging region, packed with other objects, or through a buffer of its own
when it is larger than the staging region. All objects of a round move in one transfer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from hicache.backends._buffers import address_of, copy_outside_gil
from hicache.backends.base import copy_into_segments, fill_from_segments
from hicache.backends.nixl.agent import NixlAgent, RegisteredMemory, Staging
from hicache.backends.nixl.stores import Target

__all__ = ["Job", "Mover"]

_STAGE_ALIGN = 4096  # staged objects start on page boundaries, as the plugins' I/O prefers
_COUNTERS = (
    "transfers",
    "transfer_failures",
    "zero_copy_bytes",
    "bytes_staged",
    "oversize_transfers",
)


@dataclass(slots=True)
class Job:
    """One object to move: its target and the caller's segments (the first ``size`` bytes)."""

    target: Target
    segs: list[memoryview]
    ok: bool = False


@dataclass(slots=True)
class _Round:
    direct: list[tuple[Job, list[tuple[int, int]]]] = field(default_factory=list)
    staged: list[tuple[Job, int]] = field(default_factory=list)  # (job, offset in staging)
    oversize: Job | None = None

    @property
    def jobs(self) -> list[Job]:
        jobs = [j for j, _ in self.direct] + [j for j, _ in self.staged]
        return jobs + ([self.oversize] if self.oversize else [])


def _pieces(segs: list[memoryview], size: int) -> Iterator[tuple[memoryview, int]]:
    """(segment, bytes of it used) covering the first ``size`` bytes, empty ones skipped."""
    left = size
    for seg in segs:
        if left <= 0:
            return
        n = min(seg.nbytes, left)
        if n:
            yield seg, n
            left -= n


class Mover:
    """Runs batches of jobs through one agent; counts what went which way."""

    def __init__(self, agent: NixlAgent, registered: RegisteredMemory, staging: Staging) -> None:
        self.agent = agent
        self.registered = registered
        self.staging = staging
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(_COUNTERS, 0)

    def run(self, op: str, jobs: list[Job], remote_mem: str, one_piece: bool) -> None:
        """Move every job (``op`` is WRITE or READ), setting ``job.ok``.

        A job whose segments all lie in registered memory moves as one descriptor per segment
        (POSIX: each at its offset in the file), so a header slot and its page move uncopied.
        ``one_piece`` (OBJ): an object must move as one descriptor, so scattered segments are
        staged even when registered. The OBJ plugin writes each descriptor as a whole-object
        PUT and fails one with a non-zero offset; it could read pieces as ranged GETs, but
        two requests per page (one for 160 header bytes) cost more than the copy.
        """
        for job in jobs:
            job.ok = job.target.size == 0  # nothing to move
        for rnd in self._plan([j for j in jobs if not j.ok], one_piece):
            ok = self._run_round(op, rnd, remote_mem)
            round_jobs = rnd.jobs
            if not ok and len(round_jobs) > 1:
                # One bad object (deleted meanwhile, an I/O error) fails its whole transfer:
                # move the others alone, so only that one is reported.
                for job in round_jobs:
                    self.run(op, [job], remote_mem, one_piece)
                continue
            for job in round_jobs:
                job.ok = ok

    def _plan(self, jobs: list[Job], one_piece: bool) -> list[_Round]:
        rounds: list[_Round] = []
        current, used = _Round(), 0
        capacity = self.staging.nbytes
        for job in jobs:
            direct = self._direct(job, one_piece)
            size = job.target.size
            if direct is not None:
                current.direct.append((job, direct))
            elif size > capacity:
                rounds.append(_Round(oversize=job))
            else:
                if used + size > capacity:
                    rounds.append(current)
                    current, used = _Round(), 0
                current.staged.append((job, used))
                used += -(-size // _STAGE_ALIGN) * _STAGE_ALIGN
        if current.direct or current.staged:
            rounds.append(current)
        return rounds

    def _direct(self, job: Job, one_piece: bool) -> list[tuple[int, int]] | None:
        """(address, length) pieces when every byte lies in registered memory, else None."""
        pieces = []
        for seg, n in _pieces(job.segs, job.target.size):
            address = address_of(seg)
            if not self.registered.contains(address, n):
                return None
            pieces.append((address, n))
        return None if one_piece and len(pieces) != 1 else pieces

    def _run_round(self, op: str, rnd: _Round, remote_mem: str) -> bool:
        if rnd.oversize is not None:
            return self._run_oversize(op, rnd.oversize, remote_mem)
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        direct_bytes = 0
        for job, pieces in rnd.direct:
            offset = 0
            for address, n in pieces:
                local.append((address, n, 0))
                remote.append((offset, n, job.target.dev))
                offset += n
            direct_bytes += offset
        staging = self.staging
        lock = staging.lock if rnd.staged else contextlib.nullcontext()
        with lock:
            view = staging.buffer.data
            bytes_staged = 0
            for job, offset in rnd.staged:
                size = job.target.size
                if op == "WRITE":
                    fill_from_segments(job.segs, view[offset : offset + size], copy_outside_gil)
                local.append((staging.address + offset, size, 0))
                remote.append((0, size, job.target.dev))
                bytes_staged += size
            ok = self.agent.transfer(op, local, remote, remote_mem)
            if ok and op == "READ":
                for job, offset in rnd.staged:
                    staged = view[offset : offset + job.target.size]
                    copy_into_segments(staged, job.segs, copy_outside_gil)
        self._account(ok, zero_copy_bytes=direct_bytes, bytes_staged=bytes_staged)
        return ok

    def _run_oversize(self, op: str, job: Job, remote_mem: str) -> bool:
        size = job.target.size
        with self.staging.oversize(size) as buf:
            view = buf.data
            if op == "WRITE":
                fill_from_segments(job.segs, view, copy_outside_gil)
            local = [(int(buf.ctypes.data), size, 0)]
            ok = self.agent.transfer(op, local, [(0, size, job.target.dev)], remote_mem)
            if ok and op == "READ":
                copy_into_segments(view, job.segs, copy_outside_gil)
        self._account(ok, bytes_staged=size, oversize_transfers=1)
        return ok

    def _account(self, ok: bool, **amounts: int) -> None:
        with self._lock:
            c = self.counters
            c["transfers"] += 1
            if not ok:
                c["transfer_failures"] += 1
                return
            for name, amount in amounts.items():
                c[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)
