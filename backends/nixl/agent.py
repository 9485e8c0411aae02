"""The NIXL agent as the ``nixl`` backend drives it: loading, registered host memory, transfers.

Every call into the agent runs on a worker thread, never on the event loop: with the POSIX
plugin's default AIO queue, ``transfer()`` performs buffered file I/O synchronously inside
``io_submit``, and the agent runs in NIXL's strict thread-sync mode, so a loop thread that
touched the agent could wait behind another thread's transfer. The bindings release the GIL
while they work, so those threads do not hold up the loop either.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.backends._buffers import address_of, flat_view
from hicache.errors import BackendUnavailableError, InvalidArgumentError

__all__ = [
    "INSTALL_HINT",
    "NixlAgent",
    "NixlPluginError",
    "TransferPacer",
    "RegisteredMemory",
    "Staging",
    "load_nixl_api",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'hicache[nixl]'"
# The cu12 build first: its OBJ plugin loads without CUDA, the cu13 one needs libcuobjclient.
_API_MODULES = ("nixl_cu12._api", "nixl._api")
# What a plugin that NIXL lists but cannot create usually lacks on a host like this one.
_PLUGIN_NEEDS = {
    "GDS": "CUDA and cuFile (libcuda, libcufile)",
    "GDS_MT": "CUDA and cuFile (libcuda, libcufile)",
    "GPUNETIO": "CUDA and DOCA GPUNetIO",
    "LIBFABRIC": "libfabric",
    "INFINIA": "the Infinia client libraries",
    "OBJ": "the AWS SDK libraries of the nixl-cu12 build (the cu13 build also needs "
    "libcuobjclient): pip install nixl-cu12",
}
_POLL_MAX_S = 2.5e-4  # longest sleep between two polls while the rate is unknown
_FINE_POLL_S = 1e-4  # ... and once most of the expected time has been slept away
_EXPECT_SHARE = 0.75  # of a transfer's expected time slept in one go before polling
_MIN_SAMPLE = 1 << 20  # smaller transfers are mostly fixed cost: they teach no rate


class TransferPacer:
    """How long to sleep before first polling a transfer, from the rates seen so far.

    Polling with a fixed backoff overshoots a 2 MiB x 32 batch by half a poll interval on
    average (about 0.2 ms here, where ``sleep(250 us)`` takes 350). Sleeping most of the
    expected time at once, then polling finely, overshoots less. The rate estimate follows a
    faster transfer at once and a slower one gradually, so a misjudged sleep is short rather
    than long; a fast transfer also reads as faster than the estimate only because its
    sleep ended early, so the estimate keeps climbing until sleeps stop overshooting.
    """

    def __init__(self) -> None:
        self._rate: dict[str, float] = {}  # op -> bytes per second; races only lose a sample

    def first_wait(self, op: str, nbytes: int) -> float:
        rate = self._rate.get(op)
        return 0.0 if not rate or nbytes < _MIN_SAMPLE else _EXPECT_SHARE * nbytes / rate

    def record(self, op: str, nbytes: int, seconds: float) -> None:
        if nbytes < _MIN_SAMPLE or seconds <= 0:
            return
        seen = nbytes / seconds
        old = self._rate.get(op)
        self._rate[op] = seen if old is None or seen > old else old + 0.2 * (seen - old)


class NixlPluginError(BackendUnavailableError):
    """A NIXL plugin could not be created; the message names it and the plugins NIXL has."""


def load_nixl_api() -> Any:
    """The ``nixl._api`` module of the installed build; raises with the install command.

    NIXL's Python logger writes INFO lines (two per agent) to stdout, which would corrupt
    ``--json`` output: its level defaults to WARN here (``NIXL_LOG_LEVEL`` still wins), and its
    stdout handler is moved to stderr.
    """
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # read once, when the module is imported
    for name in _API_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for handler in logging.getLogger("nixl").handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (
                sys.stdout,
                sys.__stdout__,
            ):
                handler.setStream(sys.stderr)
        return module
    raise BackendUnavailableError(
        f"the nixl backend needs the NIXL Python package (nixl-cu12), which is not installed: "
        f"{INSTALL_HINT}"
    )


@dataclass(frozen=True, slots=True)
class _Region:
    start: int
    end: int
    owner: memoryview  # keeps the registered buffer alive while NIXL may touch it
    handle: Any


class NixlAgent:
    """One NIXL agent with one storage plugin; thread-safe (NIXL strict sync mode)."""

    def __init__(self, api: Any, plugin: str, params: dict[str, str]) -> None:
        self._api = api
        conf = api.nixl_agent_config(
            enable_prog_thread=False,  # no listener or peer: transfers are local only
            backends=[],  # the default would start UCX, which a storage agent never uses
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        # Unique: several backends (and the benchmark's raw agent) may live in one process.
        self.name = f"hicache-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            self._agent = api.nixl_agent(self.name, conf)
        except Exception as exc:  # the bindings raise RuntimeError or nixl* errors
            raise BackendUnavailableError(f"NIXL agent could not start: {exc}") from exc
        self.plugin = plugin
        create_plugin(self._agent, plugin, params)
        self._dev_ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _dev_ids only; NIXL locks its own state
        self.pacer = TransferPacer()

    def next_dev_id(self) -> int:
        """A device id no other registration of this agent uses (OBJ names objects by it)."""
        with self._lock:
            return next(self._dev_ids)

    def register(self, regions: Sequence[tuple[int, int, int, str]], mem_type: str) -> Any:
        return self._agent.register_memory(list(regions), mem_type, backends=[self.plugin])

    def deregister(self, handle: Any) -> None:
        self._agent.deregister_memory(handle, backends=[self.plugin])

    def query(self, regions: Sequence[tuple[int, int, int, str]], mem_type: str) -> list[Any]:
        return list(self._agent.query_memory(list(regions), self.plugin, mem_type))

    def transfer(
        self,
        op: str,
        local: Sequence[tuple[int, int, int]],
        remote: Sequence[tuple[int, int, int]],
        remote_mem: str,
    ) -> bool:
        """Move ``local`` DRAM descriptors to or from ``remote`` ones; True once done.

        Blocks the calling (worker) thread: submits, sleeps most of the time the transfer is
        expected to take (:class:`TransferPacer`), then polls with a short backoff.
        """
        agent = self._agent
        handle = agent.initialize_xfer(
            op,
            agent.get_xfer_descs(list(local), "DRAM"),
            agent.get_xfer_descs(list(remote), remote_mem),
            self.name,  # the agent itself is the "remote" side of a storage transfer
            backends=[self.plugin],
        )
        nbytes = sum(n for _, n, _ in local)
        state, start = "ERR", time.perf_counter()
        try:
            state = agent.transfer(handle)
            state = self._wait(handle, state, self.pacer.first_wait(op, nbytes) + start)
        except Exception as exc:  # a failed transfer raises nixlBackendError from the poll
            logger.debug("NIXL %s transfer failed: %s", op, exc)
            state = "ERR"
        finally:
            agent.release_xfer_handle(handle)
        if state == "DONE":
            self.pacer.record(op, nbytes, time.perf_counter() - start)
        return bool(state == "DONE")

    def _wait(self, handle: Any, state: str, wake_at: float) -> str:
        """Poll until the transfer leaves PROC, sleeping until ``wake_at`` first."""
        agent, cap = self._agent, _POLL_MAX_S
        pause = wake_at - time.perf_counter()
        if state == "PROC" and pause > _FINE_POLL_S:
            time.sleep(pause)
            state, cap = agent.check_xfer_state(handle), _FINE_POLL_S
        delay = 0.0
        while state == "PROC":
            time.sleep(delay)
            delay = min(max(delay * 2, 1e-5), cap)
            state = agent.check_xfer_state(handle)
        return str(state)

    def close(self) -> None:
        # The bindings release the agent and its plugin when the last reference goes.
        self._agent = None


def create_plugin(agent: Any, plugin: str, params: dict[str, str]) -> None:
    """Create ``plugin`` in ``agent``; a :class:`NixlPluginError` says why it cannot be."""
    available = list(agent.get_plugin_list())
    listed = ", ".join(available) or "(none)"
    if plugin not in available:
        raise NixlPluginError(
            f"NIXL plugin {plugin!r} could not be loaded: it is not installed; "
            f"available plugins: {listed}"
        )
    try:
        agent.create_backend(plugin, params)
    except Exception as exc:  # the bindings raise nixlNotFoundError / nixlBackendError
        # The parameters are never shown: for OBJ they hold the secret key.
        needs = _PLUGIN_NEEDS.get(plugin)
        missing = f"; it needs {needs}" if needs else ""
        raise NixlPluginError(
            f"NIXL plugin {plugin!r} could not be loaded ({type(exc).__name__}){missing}; "
            f"available plugins: {listed}"
        ) from None


class RegisteredMemory:
    """Host buffers registered with the agent once, and whether a segment lies inside one."""

    def __init__(self, agent: NixlAgent) -> None:
        self._agent = agent
        self._regions: list[_Region] = []
        self._lock = threading.Lock()

    def add(self, buffer: Any) -> bool:
        """Register ``buffer`` (C-contiguous, writable or not); False if already covered."""
        view = flat_view(buffer)
        if view.nbytes == 0:
            raise InvalidArgumentError("cannot register an empty buffer")
        start = address_of(view)
        end = start + view.nbytes
        with self._lock:
            if any(r.start <= start and end <= r.end for r in self._regions):
                return False
            if any(r.start < end and start < r.end for r in self._regions):
                raise InvalidArgumentError(
                    "the buffer overlaps a registered one without lying inside it; "
                    "register the larger buffer first, or unregister the other"
                )
            handle = self._agent.register([(start, view.nbytes, 0, "")], "DRAM")
            self._regions.append(_Region(start, end, view, handle))
        return True

    def remove(self, buffer: Any) -> bool:
        """Unregister the region that starts at ``buffer``; False if there is none."""
        view = flat_view(buffer)
        start = address_of(view)
        with self._lock:
            for i, region in enumerate(self._regions):
                if region.start == start and region.end == start + view.nbytes:
                    del self._regions[i]
                    self._agent.deregister(region.handle)
                    return True
        return False

    def contains(self, start: int, nbytes: int) -> bool:
        end = start + nbytes
        # No lock: a list read is atomic, and a region is never removed during a transfer
        # that relies on it (the caller owns both the buffer and its registration).
        return any(r.start <= start and end <= r.end for r in self._regions)

    def clear(self) -> None:
        with self._lock:
            for region in self._regions:
                self._agent.deregister(region.handle)
            self._regions.clear()

    @property
    def nbytes(self) -> int:
        return sum(r.end - r.start for r in self._regions)


class Staging:
    """A registered buffer, allocated once, for segments outside registered memory."""

    def __init__(self, agent: NixlAgent, nbytes: int) -> None:
        self._agent = agent
        # np.empty: pages are faulted in by the first staged transfer, not at open.
        self.buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        self.address = int(self.buffer.ctypes.data)
        self.nbytes = nbytes
        self._handle = agent.register([(self.address, self.buffer.nbytes, 0, "")], "DRAM")
        self.lock = threading.Lock()  # one staged round at a time

    @contextlib.contextmanager
    def oversize(self, nbytes: int) -> Iterator[np.ndarray]:
        """A registered buffer of its own for one object larger than the staging region."""
        buf = np.empty(nbytes, dtype=np.uint8)
        handle = self._agent.register([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
        try:
            yield buf
        finally:
            self._agent.deregister(handle)

    def close(self) -> None:
        self._agent.deregister(self._handle)
