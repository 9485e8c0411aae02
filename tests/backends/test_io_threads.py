"""IOThreads: one loop round trip per call, items claimed across threads, nothing left running."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from hicache.backends._io_threads import IOThreads
from hicache.errors import BackendClosedError


@pytest.fixture
def threads() -> Iterator[IOThreads]:
    pool = IOThreads(4, "test-io")
    yield pool
    pool.shutdown()


async def test_spread_keeps_item_order_and_uses_several_threads(threads: IOThreads) -> None:
    seen: set[int] = set()

    def square(group: list[int]) -> list[int]:
        seen.add(threading.get_ident())
        time.sleep(0.002)  # long enough that the workers get their share
        return [x * x for x in group]

    items = list(range(37))
    out = await threads.call(threads.spread, square, items, 3)
    assert out == [x * x for x in items]
    assert len(seen) > 1


async def test_spread_of_nothing_and_of_one_group_stays_on_the_lead(threads: IOThreads) -> None:
    leads: list[str] = []

    def name(group: list[int]) -> list[str]:
        leads.append(threading.current_thread().name)
        return [str(x) for x in group]

    assert await threads.call(threads.spread, name, [], 1) == []
    assert await threads.call(threads.spread, name, [1, 2], 8) == ["1", "2"]
    assert len(leads) == 1 and "lead" in leads[0]


async def test_a_worker_error_is_raised_after_every_item_settled(threads: IOThreads) -> None:
    done: list[int] = []
    lock = threading.Lock()

    def maybe_fail(group: list[int]) -> list[int]:
        time.sleep(0.001)
        if group[0] == 5:
            raise OSError("disk on fire")
        with lock:
            done.extend(group)
        return group

    with pytest.raises(OSError, match="disk on fire"):
        await threads.call(threads.spread, maybe_fail, list(range(12)), 1)
    assert sorted(done) == [i for i in range(12) if i != 5]  # the others all ran to the end


async def test_concurrent_calls_do_not_deadlock_when_workers_are_busy() -> None:
    pool = IOThreads(2, "test-io-small")  # one worker shared by every call's spread
    try:

        def slow(group: list[int]) -> list[int]:
            time.sleep(0.001)
            return [x + 1 for x in group]

        calls = [pool.call(pool.spread, slow, list(range(i, i + 10)), 1) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*calls), timeout=10)
        assert results == [[x + 1 for x in range(i, i + 10)] for i in range(6)]
    finally:
        pool.shutdown()


async def test_a_cancelled_call_returns_only_after_its_threads_are_done(
    threads: IOThreads,
) -> None:
    finished = threading.Event()

    def slow_job() -> None:
        def item(group: list[int]) -> list[int]:
            time.sleep(0.05)
            return group

        threads.spread(item, [1, 2, 3], 1)
        finished.set()

    task = asyncio.ensure_future(threads.call(slow_job))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()  # the caller's buffers are no longer in use


async def test_calls_after_shutdown_are_typed_errors() -> None:
    pool = IOThreads(3, "test-io-closed")
    pool.shutdown()
    with pytest.raises(BackendClosedError):
        await pool.call(lambda: 1)
