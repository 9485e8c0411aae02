"""The thread that runs every forward pass, and who gets the CPU's OpenMP threads meanwhile.

torch runs a CPU op on a team of OpenMP threads that belongs to the calling thread. GNU
OpenMP (the runtime in torch's Linux wheels) lets a team's idle threads spin between ops only
while the process's OpenMP threads do not outnumber its CPUs; beyond that each op wakes its
team through the kernel. The forward runs in a thread of its own (the event loop meanwhile
moves L3 reads and writes), so once the event loop's thread has a team too (anything it
computed before, a model's weights included), the two oversubscribe a machine with few
cores and every small op of a step pays for a wake-up: on 2 cores, in one process, a 16-row DSA
decode step took 40-44 ms from a plain worker thread and 20-22 ms from this one.

So while a forward thread runs, it computes with the thread count its caller had, and the
caller (the event loop's thread) computes on one thread with its idle team released
(``omp_pause_resource_all``). The caller's count comes back when its last forward thread ends.
Where the runtime is not GNU OpenMP, only the thread counts change.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["forward_executor", "openmp_pause"]

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: release idle threads, keep the runtime usable
_caller = threading.local()  # per calling thread: open forward threads, its thread count


@contextlib.contextmanager
def forward_executor() -> Iterator[ThreadPoolExecutor]:
    """A one-thread executor for forward passes, computing with the calling thread's torch
    thread count while the calling thread computes on one."""
    threads = _enter()
    try:
        with ThreadPoolExecutor(
            1, thread_name_prefix="hicache-forward", initializer=_pin, initargs=(threads,)
        ) as pool:
            # The forward thread sets its count first: torch's count for threads that start
            # later follows the last one set, which must be the caller's one.
            pool.submit(torch.get_num_threads).result()
            torch.set_num_threads(1)
            _release_team()
            yield pool
    finally:
        _leave()


def _enter() -> int:
    depth = getattr(_caller, "depth", 0)
    if depth == 0:
        _caller.threads = torch.get_num_threads()
    _caller.depth = depth + 1
    return int(_caller.threads)


def _leave() -> None:
    _caller.depth -= 1
    if _caller.depth == 0:
        torch.set_num_threads(_caller.threads)


def _pin(threads: int) -> None:
    torch.get_num_threads()  # torch sets a new thread's count on first use: have that done
    torch.set_num_threads(threads)


def _release_team() -> None:
    pause = openmp_pause()
    if pause is not None and pause(_OMP_PAUSE_SOFT) != 0:
        logger.debug("omp_pause_resource_all refused; the caller's idle OpenMP team stays")


@functools.cache
def openmp_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the GNU OpenMP runtime this process has loaded (torch's
    own copy), None where there is none: it frees the calling thread's idle team."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        return function
    return None
