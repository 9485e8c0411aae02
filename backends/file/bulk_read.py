"""Whole-store reads of the ``file`` backend (its ``BulkReader`` side), in threads or processes.

Each worker walks a group of top-level fan-out directories, reads every object whole into its own
buffer and runs the caller's check right there; only the results come back. Small objects cost
mostly Python, which one process runs on one core at a time, so they can go to worker
processes; large ones stay in threads, whose copies and checksums run outside the GIL. The walk
and the reads are :mod:`.scan`'s: no link below the root is followed, in threads or processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import pickle
from collections.abc import AsyncGenerator
from concurrent.futures import ProcessPoolExecutor
from typing import TypeAlias, TypeVar

from hicache.backends.file.io import ReadBuffer
from hicache.backends.file.maintenance import ObjectCheck
from hicache.backends.file.scan import read_groups, read_tree

__all__ = ["picklable", "read_in_processes", "read_in_threads", "read_store"]

_WIDE_READ_BYTES = 256 << 10  # all threads are used once objects average this size

T = TypeVar("T")
#: Per group of top-level directories read: the checks' results, bytes read, failed reads.
Outcomes: TypeAlias = AsyncGenerator[tuple[list[T], int, int], None]


async def read_in_threads(
    root: str, names: list[str], prefix: str, check: ObjectCheck[T], threads: int, wide: bool
) -> Outcomes[T]:
    # A hop costs far more than a read: a few hops per thread.
    step = max(1, len(names) // (8 * max(1, threads)))
    groups = iter([names[i : i + step] for i in range(0, len(names), step)])
    idle = [ReadBuffer(1 << 20) for _ in range(max(1, threads))]
    running: dict[asyncio.Future[tuple[list[T], int, int]], ReadBuffer] = {}
    width = len(idle) if wide else 1
    try:
        while True:
            while len(running) < width and (group := next(groups, None)) is not None:
                buf = idle.pop()
                work = asyncio.to_thread(read_tree, root, group, prefix, check, buf)
                running[asyncio.ensure_future(work)] = buf
            if not running:
                return
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                idle.append(running.pop(future))
                yield future.result()
    finally:
        if running:  # threads cannot be stopped: let them finish before the buffers go
            await asyncio.wait(running)
            for future in running:
                if not future.cancelled():
                    future.exception()  # retrieved: the caller stopped reading, on purpose


async def read_in_processes(
    root: str, names: list[str], prefix: str, check: ObjectCheck[T], processes: int
) -> Outcomes[T]:
    # spawn, not fork: this process runs threads (the event loop's executor), and a fork
    # could copy a lock some other thread holds.
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    step = max(1, len(names) // (4 * processes))
    futures = [
        loop.run_in_executor(pool, read_groups, root, names[i : i + step], prefix, check)
        for i in range(0, len(names), step)
    ]
    try:
        for next_done in asyncio.as_completed(futures):
            yield await next_done
    finally:
        for future in futures:
            future.cancel()
        pool.shutdown(wait=False, cancel_futures=True)


def picklable(fn: object) -> bool:
    """Whether ``fn`` can be sent to a worker process (a module-level function can)."""
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


async def read_store(
    root: str, names: list[str], prefix: str, check: ObjectCheck[T], threads: int, processes: int
) -> Outcomes[T]:
    """``(results, bytes, failures)`` per group of the top-level directories ``names``.

    One thread reads the first directory; it tells how large objects are. Small objects cost
    mostly Python, so a large store of them goes to ``processes`` worker processes when
    ``check`` can be sent there; large objects go to ``threads`` threads, all of them busy.
    """
    buf = ReadBuffer(1 << 20)
    first = await asyncio.to_thread(read_tree, root, names[:1], prefix, check, buf)
    yield first
    rest = names[1:]
    small = not first[0] or first[1] < len(first[0]) * _WIDE_READ_BYTES
    if processes > 1 and small and len(rest) >= 16 * processes and picklable(check):
        outcomes = read_in_processes(root, rest, prefix, check, processes)
    else:
        outcomes = read_in_threads(root, rest, prefix, check, threads, wide=not small)
    async with contextlib.aclosing(outcomes) as batches:
        async for outcome in batches:
            yield outcome
