"""One Mooncake Store client as the ``mooncake`` backend drives it: setup, memory, batched moves.

Everything here is synchronous and runs on the backend's single worker thread (the client is
not documented as thread-safe, and the staging buffer is shared by every call). Results are
Mooncake's raw status codes; the backend turns them into hits, misses and counters.

Data always moves with ``batch_upsert_from`` / ``batch_get_into`` between the store and
registered memory: straight from or to the caller's buffer when it lies inside memory given to
:meth:`MooncakeClient.register`, else through one staging buffer registered at setup. A batch
whose staged bytes exceed the staging buffer moves in several calls; one object larger than the
whole staging buffer gets a registered buffer of its own for that call.
"""

from __future__ import annotations

import bisect
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.backends._buffers import address_of
from hicache.backends.base import copy_into_segments, segments_nbytes
from hicache.errors import BackendLoadError, BackendUnavailableError

__all__ = [
    "INSTALL_HINT",
    "MooncakeClient",
    "RegisteredRanges",
    "SetupParams",
    "lost_master",
    "master_address",
    "load_store_class",
]

INSTALL_HINT = "pip install 'hicache[mooncake]' and apt-get install libibverbs1"
# Mooncake ErrorCode values this package reacts to (mooncake-store types.h).
OK = 0
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: every segment is full
INVALID_PARAMS = -600  # also what batch_get_into answers for a buffer too small
NOT_FOUND = -704  # OBJECT_NOT_FOUND
RPC_FAIL = -900
CONNECTION_CODES = frozenset({RPC_FAIL, -1010})  # -1010: the master is not serving (yet)


def load_store_class() -> Any:
    """``MooncakeDistributedStore``; raises :class:`BackendLoadError` with the install command."""
    # Before the library loads: its INFO lines (several per client) would drown a service log.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise BackendLoadError(
            f"the mooncake backend needs Mooncake Store's Python client ({exc}): {INSTALL_HINT} "
            "(on CUDA hosts, mooncake-transfer-engine instead of the -non-cuda build)"
        ) from exc
    return module.MooncakeDistributedStore


def lost_master(codes: Sequence[int]) -> bool:
    """Whether any status code says the master could not be reached."""
    return any(rc in CONNECTION_CODES for rc in codes)


class RegisteredRanges:
    """Sorted, non-overlapping address ranges; answers "does [a, a+n) lie inside one?"."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def contains(self, start: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + nbytes <= self._ends[i]

    def add(self, start: int, nbytes: int) -> None:
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, start + nbytes)

    def remove(self, start: int) -> int | None:
        """Forget the range starting at ``start``; its length, or None if there is none."""
        i = bisect.bisect_left(self._starts, start)
        if i == len(self._starts) or self._starts[i] != start:
            return None
        self._starts.pop(i)
        return self._ends.pop(i) - start

    def overlaps(self, start: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, start + nbytes - 1) - 1
        return i >= 0 and self._ends[i] > start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((s, e - s) for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))


@dataclass(frozen=True, slots=True)
class SetupParams:
    """What ``MooncakeDistributedStore.setup`` needs, in its positional order."""

    local_hostname: str
    metadata_server: str
    global_segment_bytes: int
    local_buffer_bytes: int
    protocol: str
    rdma_devices: str
    master: str
    prefer_local: bool = True  # not a setup argument: where this client's puts are placed

    def setup_args(self) -> tuple[Any, ...]:
        """The arguments of ``MooncakeDistributedStore.setup``, in its order."""
        return (
            self.local_hostname,
            self.metadata_server,
            self.global_segment_bytes,
            self.local_buffer_bytes,
            self.protocol,
            self.rdma_devices,
            self.master,
        )


def master_address(master: str) -> tuple[str, int]:
    """(host, port) of a ``host:port`` or ``[v6]:port`` master address."""
    host, _, port = master.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class _Move:
    """One object of a batch: where it moves from or to, and how to finish a staged read."""

    index: int
    address: int
    nbytes: int
    segments: list[memoryview] | None = None  # staged: the caller's segments
    staged_at: int = -1  # offset in the staging buffer (or 0 in an oversize buffer)


class MooncakeClient:
    """A set-up ``MooncakeDistributedStore`` plus its registered memory and staging buffer."""

    def __init__(self, store_cls: Any, params: SetupParams, staging_bytes: int) -> None:
        self.params = params
        self.store = store_cls()
        rc = self.store.setup(*params.setup_args())
        if rc != OK:
            raise BackendUnavailableError(
                f"Mooncake client setup against master {params.master} (metadata server "
                f"{params.metadata_server}, protocol {params.protocol}) failed with code {rc}; "
                "check that the master runs with --enable_http_metadata_server=true when the "
                "metadata server is its HTTP one, and that local_hostname is reachable"
            )
        # np.empty: pages are faulted in by the first staged move, not at open.
        self.staging = np.empty(max(staging_bytes, 1), dtype=np.uint8)
        self.staging_address = int(self.staging.ctypes.data)
        self.regions = RegisteredRanges()
        self._check_register(self.staging_address, self.staging.nbytes)
        self.placement = _placement(self.store, params.prefer_local)
        self.zero_copy_bytes = 0
        self.staged_bytes = 0
        self.oversize_moves = 0

    def register(self, address: int, nbytes: int) -> None:
        self._check_register(address, nbytes)
        self.regions.add(address, nbytes)

    def unregister(self, address: int) -> bool:
        if self.regions.remove(address) is None:
            return False
        self.store.unregister_buffer(address)
        return True

    def adopt_regions(self, regions: RegisteredRanges) -> None:
        """Register again what a previous client had (after a rebuild)."""
        for start, nbytes in regions:
            self.register(start, nbytes)

    def close(self) -> None:
        self.store.close()

    # ----- data -----------------------------------------------------------------------------
    def put(self, mkeys: list[str], values: Sequence[list[memoryview]]) -> list[int]:
        """Upsert each non-empty value; per key, Mooncake's status code."""
        codes = [RPC_FAIL] * len(mkeys)  # what a key not reached keeps
        for moves, oversize in self._plan(values, staged_sizes=None):
            target = self.staging if oversize is None else oversize
            for m in moves:
                if m.segments is not None:
                    _fill(target, m.staged_at, m.segments)
            out = self.store.batch_upsert_from(
                [mkeys[m.index] for m in moves],
                [m.address for m in moves],
                [m.nbytes for m in moves],
                self.placement,
            )
            for m, rc in zip(moves, out, strict=True):
                codes[m.index] = rc
                self._account(m, m.nbytes if rc == OK else 0)
            if lost_master(out):  # every further call would wait out the same timeout
                break
        return codes

    def get_into(self, mkeys: list[str], buffers: Sequence[list[memoryview]]) -> list[int]:
        """Read each object into its buffer; per key, its size or Mooncake's status code.

        A size larger than the buffer means nothing was read (``get_size`` was asked).
        """
        codes = [RPC_FAIL] * len(mkeys)
        pending = list(range(len(mkeys)))
        while pending:  # a key twice in one batch_get_into fills only one of its buffers
            now: list[int] = []
            later: list[int] = []
            seen: set[str] = set()
            for i in pending:
                (later if mkeys[i] in seen else now).append(i)
                seen.add(mkeys[i])
            pending = later
            out = self._get_unique([mkeys[i] for i in now], [buffers[i] for i in now])
            for i, rc in zip(now, out, strict=True):
                codes[i] = rc
            if lost_master(out):
                break
        return codes

    def _get_unique(self, mkeys: list[str], buffers: Sequence[list[memoryview]]) -> list[int]:
        codes = [RPC_FAIL] * len(mkeys)
        for moves, oversize in self._plan(buffers, staged_sizes=segments_nbytes):
            source = (self.staging if oversize is None else oversize).data
            out = self.store.batch_get_into(
                [mkeys[m.index] for m in moves],
                [m.address for m in moves],
                [m.nbytes for m in moves],
            )
            for m, rc in zip(moves, out, strict=True):
                codes[m.index] = rc
                if 0 <= rc <= m.nbytes and m.segments is not None:
                    copy_into_segments(source[m.staged_at : m.staged_at + rc], m.segments)
                self._account(m, rc if 0 <= rc <= m.nbytes else 0)
            if lost_master(out):
                break
        for i, rc in enumerate(codes):
            if rc == INVALID_PARAMS:  # the buffer may be too small: ask the real size
                size = self.store.get_size(mkeys[i])
                codes[i] = size if size > segments_nbytes(buffers[i]) else rc
        return codes

    def put_marker(self, mkeys: list[str]) -> list[int]:
        """Store a one-byte object under each key (the marker of an empty object)."""
        n = len(mkeys)
        addresses, sizes = [self.staging_address] * n, [1] * n
        return list(self.store.batch_upsert_from(mkeys, addresses, sizes, self.placement))

    # ----- planning -------------------------------------------------------------------------
    def _plan(
        self,
        items: Sequence[list[memoryview]],
        staged_sizes: Callable[[list[memoryview]], int] | None,
    ) -> Iterator[tuple[list[_Move], np.ndarray | None]]:
        """Rounds of moves: direct ones with the first staged chunk, then further chunks.

        ``staged_sizes`` gives a read's room in staging (the caller's capacity); a write
        stages exactly its bytes. An oversize round is one object with its own buffer.
        """
        direct: list[_Move] = []
        staged: list[tuple[int, list[memoryview], int]] = []
        for i, segs in enumerate(items):
            nbytes = segments_nbytes(segs) if staged_sizes is None else staged_sizes(segs)
            if len(segs) == 1 and nbytes > 0:
                address = address_of(segs[0])
                if self.regions.contains(address, nbytes):
                    direct.append(_Move(i, address, nbytes))
                    continue
            staged.append((i, segs, nbytes))
        round_: list[_Move] = direct
        offset, limit = 0, self.staging.nbytes
        for i, segs, nbytes in staged:
            if nbytes > limit:
                yield from self._oversize(i, segs, nbytes)
                continue
            if offset + nbytes > limit:
                yield round_, None
                round_, offset = [], 0
            round_.append(_Move(i, self.staging_address + offset, nbytes, segs, offset))
            offset += nbytes
        if round_:
            yield round_, None

    def _oversize(
        self, index: int, segs: list[memoryview], nbytes: int
    ) -> Iterator[tuple[list[_Move], np.ndarray]]:
        buffer = np.empty(nbytes, dtype=np.uint8)
        address = int(buffer.ctypes.data)
        self._check_register(address, nbytes)
        self.oversize_moves += 1
        try:
            yield [_Move(index, address, nbytes, segs, 0)], buffer
        finally:
            self.store.unregister_buffer(address)

    def _account(self, move: _Move, moved: int) -> None:
        if move.segments is None:
            self.zero_copy_bytes += moved
        else:
            self.staged_bytes += moved

    def _check_register(self, address: int, nbytes: int) -> None:
        rc = self.store.register_buffer(address, nbytes)
        if rc != OK:
            raise BackendUnavailableError(
                f"Mooncake could not register {nbytes} bytes of memory (code {rc})"
            )


def _fill(staging: np.ndarray, offset: int, segs: list[memoryview]) -> None:
    for seg in segs:
        n = seg.nbytes
        staging[offset : offset + n] = np.frombuffer(seg, dtype=np.uint8)
        offset += n


def _placement(store: Any, prefer_local: bool) -> Any:
    """The ReplicateConfig of this client's puts: its own segment first when asked.

    A put into the local segment is a memcpy; one into another client's segment crosses the
    transfer engine (TCP here), measured 2-4x slower even within one host. The preference is
    soft: Mooncake places the object elsewhere when the local segment is full.
    """
    config = importlib.import_module("mooncake.store").ReplicateConfig()
    if prefer_local:
        config.preferred_segment = store.get_hostname()
    return config
