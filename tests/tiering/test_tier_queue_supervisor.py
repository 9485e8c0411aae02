"""The L3 write queue and the supervised background tasks, on their own.

``StorageTier.submit_write`` is driven on a tier with no workers (no L3 opened), so nothing
leaves the queue unless the test says so; the supervisor runs plain coroutines.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from gated_kit import assert_clean, tokens, until
from tier_kit import Harness

from hicache.backends.memory import MemoryBackend
from hicache.tiering.common.config import StorageConfig
from hicache.tiering.l3.bundler import BundlePage
from hicache.tiering.l3.storage_tier import StorageTier, WriteJob
from hicache.tiering.l3.supervisor import TaskSupervisor


# ----- StorageTier.submit_write on its own (no workers: nothing leaves the queue) ---------------
def _job(pages: int, value: float) -> WriteJob:
    page = BundlePage(b"\0" * 32, b"\1" * 32, {"kv": 0})
    return WriteJob([page] * pages, value)


def _submitted(tier: StorageTier, *jobs: WriteJob) -> tuple[WriteJob, ...]:
    """Submit ``jobs`` in order; they come back for the asserts."""
    for job in jobs:
        tier.submit_write(job)
    return jobs


@pytest.fixture
async def queue4() -> AsyncIterator[tuple[Harness, StorageTier]]:
    """A tier whose write queue holds 4 pages, closed after the test."""
    async with await Harness.build(storage=StorageConfig(write_queue_pages=4)) as h:
        yield h, h.controller.storage


async def test_submit_write_drops_the_least_valuable_first(
    queue4: tuple[Harness, StorageTier],
) -> None:
    h, tier = queue4
    low, mid = _submitted(tier, _job(2, 1.0), _job(2, 5.0))
    assert tier.queued_pages == 4 and not tier.write_acks
    high = _job(2, 9.0)
    tier.submit_write(high)  # low goes, mid stays
    assert list(tier.write_acks) == [low] and low.dropped and low.ok == [False, False]
    assert list(tier._queue) == [mid, high] and tier.queued_pages == 4
    cheap = _job(1, 0.5)
    tier.submit_write(cheap)  # worth less than all queued: itself dropped
    assert cheap.dropped and tier.write_acks[-1] is cheap and list(tier._queue) == [mid, high]
    assert h.controller.metrics.counts["dropped_writes"] == 3
    empty = _job(0, 0.0)
    tier.submit_write(empty)
    assert empty.ok == [] and not empty.dropped


async def test_submit_write_breaks_ties_by_dropping_the_newest(
    queue4: tuple[Harness, StorageTier],
) -> None:
    _, tier = queue4
    old, new, _ = _submitted(tier, _job(2, 1.0), _job(2, 1.0), _job(2, 3.0))
    assert new.dropped and not old.dropped


async def test_submit_write_drops_nothing_for_a_job_that_cannot_fit(
    queue4: tuple[Harness, StorageTier],
) -> None:
    _, tier = queue4
    cheap, dear = _submitted(tier, _job(2, 1.0), _job(2, 10.0))
    middling = _job(4, 5.0)  # would need dear's room too, which is worth more
    tier.submit_write(middling)
    assert middling.dropped
    assert not cheap.dropped and list(tier._queue) == [cheap, dear]


# ----- supervised workers -------------------------------------------------------------------------
async def test_supervisor_restarts_a_failing_worker_and_counts_it() -> None:
    seen: list[tuple[str, str]] = []
    supervisor = TaskSupervisor(lambda name, exc: seen.append((name, str(exc))), max_backoff_s=0.02)
    runs = 0

    async def worker() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"boom {runs}")

    supervisor.start("w", worker)
    await until(lambda: not supervisor.running)
    assert runs == 3 and supervisor.failures == {"w": 2}
    assert seen == [("w", "boom 1"), ("w", "boom 2")]
    await supervisor.stop()


async def test_supervisor_stop_cancels_its_workers_cleanly() -> None:
    supervisor = TaskSupervisor()
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    supervisor.start("a", forever)
    supervisor.start("b", forever)
    with pytest.raises(RuntimeError, match="already running"):
        supervisor.start("a", forever)
    await asyncio.sleep(0)
    assert sorted(supervisor.running) == ["a", "b"]
    await supervisor.stop()
    assert cancelled.is_set() and supervisor.running == [] and supervisor.failures == {}


async def test_a_crashed_l3_writer_is_restarted() -> None:
    async with await Harness.build(backend=MemoryBackend(), storage=StorageConfig(workers=1)) as h:
        tier = h.controller.storage
        real = tier._write_job
        crashes = 0

        async def crash_once(job: WriteJob) -> list[bool]:
            nonlocal crashes
            if crashes == 0:
                crashes += 1
                raise RuntimeError("writer bug")
            return await real(job)

        tier._write_job = crash_once  # type: ignore[method-assign]
        h.run_request("a", tokens(1, 2))
        await until(lambda: crashes == 1)
        await assert_clean(h)  # the crashed job was acknowledged as failed: pages released
        assert h.controller.metrics.counts["task_restarts"] == 1
        h.run_request("b", tokens(500, 2))
        await assert_clean(h)
        assert h.controller.metrics.counts["pages_written_l3"] == 2  # the new worker writes
