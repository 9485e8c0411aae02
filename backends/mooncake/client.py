"""One Mooncake Store client as the ``mooncake`` backend drives it: setup, memory, batched moves.

Everything here is synchronous and runs on the backend's single worker thread (the client is
not documented as thread-safe, and the staging buffer is shared by every call). Results are
Mooncake's raw status codes; the backend turns them into hits, misses and counters.

An object moves straight from or to the caller's memory when every segment of it lies inside
memory given to :meth:`MooncakeClient.register` (``zero_copy_bytes``): one segment with
``batch_upsert_from`` / ``batch_get_into``, several (a page's header slot and its payload) with
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``. Anything else is copied
through one staging buffer registered at setup (``bytes_staged``). A batch whose staged bytes
exceed the staging buffer moves in several rounds; one object larger than the whole staging
buffer gets a registered buffer of its own for its round. A round makes one batched call per
kind of move it holds (single-pointer, multi-pointer).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.backends._buffers import copy_outside_gil
from hicache.backends.base import copy_into_segments, fill_from_segments, segments_nbytes
from hicache.backends.mooncake.plan import Move, Plan, RegisteredRanges, Scatter, classify, trimmed
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
INVALID_PARAMS = -600  # also what the reads answer for buffers too small
NOT_FOUND = -704  # OBJECT_NOT_FOUND
TRANSFER_FAIL = -800  # also what a multi-buffer read answers for buffers larger than the object
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
class _Round:
    """What one round moves: single-pointer moves (staged ones in ``buffer``) and scattered
    objects."""

    moves: list[Move]
    scattered: list[Scatter]
    buffer: np.ndarray  # the staging buffer, or an oversize object's own


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
        self.bytes_staged = 0
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

    # ----- writes -----------------------------------------------------------------------------
    def put(self, mkeys: list[str], values: Sequence[list[memoryview]]) -> list[int]:
        """Store each non-empty value, replacing what was there; per key, Mooncake's code."""
        codes = [RPC_FAIL] * len(mkeys)  # what a key not reached keeps
        plan = classify(values, self.regions, segments_nbytes)
        self._stage_overwrites(mkeys, values, plan)
        for rnd in self._rounds(plan):
            if not self._put_round(mkeys, rnd, codes):
                break  # every further call would wait out the same timeout
        return codes

    def _stage_overwrites(
        self, mkeys: list[str], values: Sequence[list[memoryview]], plan: Plan
    ) -> None:
        """Move scattered values whose key may already exist to the staged (upsert) path.

        ``batch_put_from_multi_buffers`` does not replace: for a key that exists it answers 0
        and writes nothing (measured), and Mooncake has no multi-buffer upsert. So the keys are
        checked first, in one call; those present, or that the check could not answer, are
        upserted from staging. The tiered cache writes only pages L3 lacks, so this path is
        idle there. A key another client writes between the check and the put keeps that
        client's value, as if this put had come first.
        """
        if not plan.scattered:
            return
        found = self.store.batch_is_exist([mkeys[s.index] for s in plan.scattered])
        fresh: list[Scatter] = []
        for s, present in zip(plan.scattered, found, strict=True):
            if present == 0:
                fresh.append(s)
            else:
                plan.staged.append((s.index, values[s.index], s.nbytes))
        plan.scattered = fresh

    def _put_round(self, mkeys: list[str], rnd: _Round, codes: list[int]) -> bool:
        """Run one round's puts into ``codes``; False once the master could not be reached."""
        if rnd.moves:
            for m in rnd.moves:
                if m.segments is not None:
                    staged = rnd.buffer.data[m.staged_at : m.staged_at + m.nbytes]
                    fill_from_segments(m.segments, staged, copy_outside_gil)
            out = self.store.batch_upsert_from(
                [mkeys[m.index] for m in rnd.moves],
                [m.address for m in rnd.moves],
                [m.nbytes for m in rnd.moves],
                self.placement,
            )
            for m, rc in zip(rnd.moves, out, strict=True):
                codes[m.index] = rc
                self._account(m, m.nbytes if rc == OK else 0)
            if lost_master(out):
                return False
        if rnd.scattered:
            out = self._put_scattered([mkeys[s.index] for s in rnd.scattered], rnd.scattered)
            for s, rc in zip(rnd.scattered, out, strict=True):
                codes[s.index] = rc
            return not lost_master(out)
        return True

    def _put_scattered(self, mkeys: list[str], scattered: list[Scatter]) -> list[int]:
        """One multi-buffer put from registered memory (it keeps the object of a key that
        exists); per key, Mooncake's code. The bytes stored count as zero-copy."""
        addresses, sizes = [s.addresses for s in scattered], [s.sizes for s in scattered]
        out = list(self.store.batch_put_from_multi_buffers(mkeys, addresses, sizes, self.placement))
        self.zero_copy_bytes += sum(s.nbytes for s, rc in zip(scattered, out) if rc == OK)
        return out

    def put_missing(self, mkeys: list[str], values: Sequence[list[memoryview]]) -> list[int] | None:
        """Store each value whose key is absent, keeping the objects of present keys, in one
        call; None when a value does not lie wholly in registered memory (then the caller
        checks and puts). Mooncake's multi-buffer put answers OK for a key that exists and
        leaves its object: that is exactly this operation, with no existence check first.
        """
        plan = classify(values, self.regions, segments_nbytes)
        if plan.direct or plan.staged or not plan.scattered:
            return None
        return self._put_scattered(mkeys, plan.scattered)

    def put_marker(self, mkeys: list[str]) -> list[int]:
        """Store a one-byte object under each key (the marker of an empty object)."""
        n = len(mkeys)
        addresses, sizes = [self.staging_address] * n, [1] * n
        return list(self.store.batch_upsert_from(mkeys, addresses, sizes, self.placement))

    # ----- reads ------------------------------------------------------------------------------
    def get_into(self, mkeys: list[str], buffers: Sequence[list[memoryview]]) -> list[int]:
        """Read each object into its buffer; per key, its size or Mooncake's status code.

        A size larger than the buffer means nothing was read (``get_size`` was asked).
        """
        codes = [RPC_FAIL] * len(mkeys)
        pending = list(range(len(mkeys)))
        while pending:  # a key twice in one batched read fills only one of its buffers
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
        plan = classify(buffers, self.regions, segments_nbytes)
        for rnd in self._rounds(plan):
            if not self._get_round(mkeys, rnd, codes):
                break
        self._resolve_sizes(mkeys, buffers, plan.scattered, codes)
        return codes

    def _get_round(self, mkeys: list[str], rnd: _Round, codes: list[int]) -> bool:
        """Run one round's reads into ``codes``; False once the master could not be reached."""
        if rnd.moves:
            source = rnd.buffer.data
            out = self.store.batch_get_into(
                [mkeys[m.index] for m in rnd.moves],
                [m.address for m in rnd.moves],
                [m.nbytes for m in rnd.moves],
            )
            for m, rc in zip(rnd.moves, out, strict=True):
                codes[m.index] = rc
                fits = 0 <= rc <= m.nbytes
                if fits and m.segments is not None:
                    copy_into_segments(source[m.staged_at : m.staged_at + rc], m.segments)
                self._account(m, rc if fits else 0)
            if lost_master(out):
                return False
        return self._get_scattered(mkeys, rnd.scattered, codes) if rnd.scattered else True

    def _get_scattered(self, mkeys: list[str], scattered: list[Scatter], codes: list[int]) -> bool:
        out = self.store.batch_get_into_multi_buffers(
            [mkeys[s.index] for s in scattered],
            [s.addresses for s in scattered],
            [s.sizes for s in scattered],
            False,  # prefer_alloc_in_same_node: no effect on reads into registered memory
        )
        for s, rc in zip(scattered, out, strict=True):
            codes[s.index] = rc
            self.zero_copy_bytes += rc if 0 <= rc <= s.nbytes else 0
        return not lost_master(out)

    def _resolve_sizes(
        self,
        mkeys: list[str],
        buffers: Sequence[list[memoryview]],
        scattered: list[Scatter],
        codes: list[int],
    ) -> None:
        """Turn "buffer too small" into the object's size, and re-read scattered objects
        smaller than their buffers over just the bytes they need.

        ``batch_get_into`` fills a larger buffer; the multi-buffer read refuses any total but
        the object's size: -600 below it, -800 above it (measured), nothing read either way.
        """
        by_index = {s.index: s for s in scattered}
        again: list[Scatter] = []
        for i, rc in enumerate(codes):
            if rc != INVALID_PARAMS and not (rc == TRANSFER_FAIL and i in by_index):
                continue
            size = self.store.get_size(mkeys[i])
            room = segments_nbytes(buffers[i])
            if size > room or size == NOT_FOUND:  # too small, or removed meanwhile
                codes[i] = size
            elif 0 < size < room and i in by_index:
                again.append(trimmed(by_index[i], size))
        if again:
            self._get_scattered(mkeys, again, codes)

    # ----- rounds -----------------------------------------------------------------------------
    def _rounds(self, plan: Plan) -> Iterator[_Round]:
        """Direct and scattered moves with the first staged chunk, then further chunks.

        A staged read takes its buffer's room in staging; a write exactly its bytes. An
        oversize round is one object with a buffer of its own.
        """
        round_ = _Round(list(plan.direct), list(plan.scattered), self.staging)
        offset, limit = 0, self.staging.nbytes
        for i, segs, nbytes in plan.staged:
            if nbytes > limit:
                yield from self._oversize(i, segs, nbytes)
                continue
            if offset + nbytes > limit:
                yield round_
                round_, offset = _Round([], [], self.staging), 0
            round_.moves.append(Move(i, self.staging_address + offset, nbytes, segs, offset))
            offset += nbytes
        if round_.moves or round_.scattered:
            yield round_

    def _oversize(self, index: int, segs: list[memoryview], nbytes: int) -> Iterator[_Round]:
        buffer = np.empty(nbytes, dtype=np.uint8)
        address = int(buffer.ctypes.data)
        self._check_register(address, nbytes)
        self.oversize_moves += 1
        try:
            yield _Round([Move(index, address, nbytes, segs, 0)], [], buffer)
        finally:
            self.store.unregister_buffer(address)

    def _account(self, move: Move, moved: int) -> None:
        if move.segments is None:
            self.zero_copy_bytes += moved
        else:
            self.bytes_staged += moved

    def _check_register(self, address: int, nbytes: int) -> None:
        rc = self.store.register_buffer(address, nbytes)
        if rc != OK:
            raise BackendUnavailableError(
                f"Mooncake could not register {nbytes} bytes of memory (code {rc})"
            )


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
