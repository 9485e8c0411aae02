"""Where the HiSparse hot buffer's host-to-device copies run, and how long they took.

Each decode layer's copies (the fused step's misses into their victim slots, then the new
token's latent into its slot and to host) are one job, handed to a :class:`LayerCopies` as soon
as the fused step has run; the layer computes what does not need the pages (its queries) and
then waits on the job's :class:`PendingCopy` before attention reads the buffer. One API, three
places:

* :class:`InlineCopies` (``CopyMode.SYNC``): the job runs in the caller, at once: the
  synchronous path, which every other one must match token for token;
* :class:`ThreadCopies` (``CopyMode.OVERLAP`` on the CPU): a named worker thread runs the jobs
  in order while the forward goes on; the consumer blocks on a future, and an exception in a
  job is raised in the consumer (as :class:`HotCopyError`) and by every later launch;
* :class:`StreamCopies` (``CopyMode.OVERLAP`` on CUDA): the job's kernels are queued on a side
  stream after the work that produced their inputs; the consumer's stream waits on an event,
  so the host never blocks.

:class:`CopyTimes` says how much copy time the consumer did not wait for: ``copy_s`` is the
jobs' own run time, ``waited_s`` the time the consumer was blocked on them, and ``hidden`` is
``1 - waited_s / copy_s``, at least 0 (the consumer's wait also counts the handoff to the
thread, so a small job can be waited for longer than it ran). On CUDA the consumer's wait is a
stream wait, invisible to the host: ``waited_s`` is then not measured (``host_waits`` False).
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from hicache.errors import HiCacheError

__all__ = [
    "CopyMode",
    "CopyTimes",
    "HotCopyError",
    "InlineCopies",
    "LayerCopies",
    "PendingCopy",
    "StreamCopies",
    "ThreadCopies",
    "layer_copies",
]

Job = Callable[[], None]
_IDLE_EXIT_S = 1.0  # an idle worker ends; the next launch starts a new one


class CopyMode(enum.Enum):
    """How the hot buffer's copies run against the forward."""

    SYNC = "sync"  # in the forward's thread, before the layer goes on
    OVERLAP = "overlap"  # beside it: a copy thread on the CPU, a side stream on CUDA


class HotCopyError(HiCacheError, RuntimeError):
    """A hot buffer copy failed; the buffer's contents can no longer be trusted."""


@dataclass(slots=True)
class CopyTimes:
    copy_s: float = 0.0  # the jobs' run time
    waited_s: float = 0.0  # the consumer's time blocked on them
    jobs: int = 0
    host_waits: bool = True  # False on CUDA: the consumer's wait is a stream wait

    @property
    def hidden(self) -> float | None:
        """The fraction of copy time the consumer did not wait for (None: not measured)."""
        if not self.host_waits or self.copy_s <= 0:
            return None
        return max(0.0, 1.0 - self.waited_s / self.copy_s)


class PendingCopy(Protocol):
    def wait(self) -> None:
        """Return once the copy's results may be read (on CUDA: by the current stream)."""
        ...


class LayerCopies(Protocol):
    times: CopyTimes

    def launch(self, job: Job, inputs: tuple[torch.Tensor, ...] = ()) -> PendingCopy:
        """Run ``job`` (which reads ``inputs``, tensors the caller may drop at once)."""
        ...

    def drain(self) -> None:
        """Return once every job launched so far has run."""
        ...

    def close(self) -> None:
        """Stop; later launches raise :class:`HotCopyError`."""
        ...


class _Done:
    def wait(self) -> None:
        return None


class InlineCopies:
    """The synchronous path: each job runs in the caller when launched."""

    def __init__(self) -> None:
        self.times = CopyTimes()

    def launch(self, job: Job, inputs: tuple[torch.Tensor, ...] = ()) -> PendingCopy:
        began = time.perf_counter()
        job()
        spent = time.perf_counter() - began
        self.times.copy_s += spent
        self.times.waited_s += spent  # the caller waited for all of it
        self.times.jobs += 1
        return _Done()

    def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


class _FuturePending:
    def __init__(self, future: Future[None], times: CopyTimes) -> None:
        self._future = future
        self._times = times

    def wait(self) -> None:
        began = time.perf_counter()
        try:
            self._future.result()
        except BaseException as exc:
            raise HotCopyError(f"a HiSparse copy failed: {exc!r}") from exc
        finally:
            self._times.waited_s += time.perf_counter() - began


class ThreadCopies:
    """A worker thread, ``name``, that runs the jobs in launch order.

    The worker starts on the first launch and ends after an idle second (or at
    :meth:`close`, which joins it); a job's exception fails its future, and the copier: every
    later launch raises it. The worker never outlives a forward by more than its idle wait.
    """

    def __init__(self, name: str = "hisparse-copies") -> None:
        self.name = name
        self.times = CopyTimes()
        self._jobs: queue.SimpleQueue[tuple[Job, Future[None]] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failed: BaseException | None = None
        self._closed = False
        self._last: Future[None] | None = None

    def launch(self, job: Job, inputs: tuple[torch.Tensor, ...] = ()) -> PendingCopy:
        with self._lock:
            if self._closed:
                raise HotCopyError("the HiSparse copy thread is closed")
            if self._failed is not None:
                raise HotCopyError(f"an earlier HiSparse copy failed: {self._failed!r}")
            future: Future[None] = Future()
            self._jobs.put((job, future))
            self._last = future
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name=self.name)
                self._worker.start()
        return _FuturePending(future, self.times)

    def _run(self) -> None:
        while True:
            try:
                item = self._jobs.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:  # no launch can slip in between the check and the exit
                    if self._jobs.empty():
                        self._worker = None
                        return
                continue
            if item is None:
                return
            job, future = item
            began = time.perf_counter()
            try:
                job()
            except BaseException as exc:  # handed to the consumer, which raises it
                self._failed = self._failed or exc
                future.set_exception(exc)
            else:
                future.set_result(None)
            finally:
                self.times.copy_s += time.perf_counter() - began
                self.times.jobs += 1

    def drain(self) -> None:
        last = self._last
        if last is not None:
            _FuturePending(last, CopyTimes()).wait()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            worker = self._worker
            if worker is not None and worker.is_alive():
                self._jobs.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join()


class _EventPending:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)


class StreamCopies:
    """Jobs queued on a side CUDA stream of ``device``, each after the work already queued on
    the launching stream (which produced its inputs); the consumer's stream waits on an event
    recorded after the job. Run times come from timing events, read at :meth:`drain`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.times = CopyTimes(host_waits=False)
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._closed = False

    def launch(self, job: Job, inputs: tuple[torch.Tensor, ...] = ()) -> PendingCopy:
        if self._closed:
            raise HotCopyError("the HiSparse copy stream is closed")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for tensor in inputs:  # not reused by the allocator before the side stream read it
            tensor.record_stream(self.stream)
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            job()
            end.record(self.stream)
        self._spans.append((begin, end))
        self.times.jobs += 1
        return _EventPending(end)

    def drain(self) -> None:
        self.stream.synchronize()
        for begin, end in self._spans:
            self.times.copy_s += begin.elapsed_time(end) / 1000.0
        self._spans = []

    def close(self) -> None:
        if not self._closed:
            self.drain()
        self._closed = True


def layer_copies(mode: CopyMode, device: torch.device) -> LayerCopies:
    """The copier for ``mode`` on ``device``."""
    if mode is CopyMode.SYNC:
        return InlineCopies()
    if device.type == "cuda":
        return StreamCopies(device)
    return ThreadCopies()
