"""Events, not polling: acknowledged writes and finished prefetches wake whoever waits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from gated_kit import Gate, GatedBackend, seed_l3, start_prefetch, tokens, until
from tier_kit import Harness

from hicache.backends.memory import MemoryBackend
from hicache.tiering.common.config import PrefetchConfig
from hicache.tiering.common.policies import PrefetchStopPolicy

SEQ = tokens(1, 8)
WAIT = PrefetchConfig(stop_policy=PrefetchStopPolicy.WAIT_COMPLETE, threshold_tokens=4)


@pytest.fixture
async def gated_writes() -> AsyncIterator[tuple[Harness, Gate]]:
    """A harness whose L3 writes wait at a shut gate; closed after the test."""
    writes = Gate()
    async with await Harness.build(backend=GatedBackend(MemoryBackend(), put=writes)) as h:
        yield h, writes


async def test_an_acknowledged_write_wakes_a_waiter_at_once(
    gated_writes: tuple[Harness, Gate],
) -> None:
    h, writes = gated_writes
    h.run_request("a", SEQ)
    await until(lambda: writes.waiting == 1)
    assert not h.tree.idle
    waiter = asyncio.ensure_future(h.tree.storage.wait_for_activity(30.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # nothing finished: it sleeps, it does not poll out
    writes.open()
    await asyncio.wait_for(waiter, 1.0)  # far below its 30 s timeout
    await h.tree.quiesce(5.0)
    assert h.tree.idle and h.controller.metrics.counts["pages_written_l3"] == 8


async def test_quiesce_waits_for_a_running_prefetch_and_applies_it() -> None:
    reads = Gate(opened=True)
    async with await Harness.build(
        backend=GatedBackend(MemoryBackend(), get=reads), prefetch=WAIT
    ) as h:
        await seed_l3(h, SEQ)
        reads.shut()
        start_prefetch(h, "r", SEQ)
        await until(lambda: reads.waiting == 1)
        quiet = asyncio.ensure_future(h.tree.quiesce(30.0))
        await asyncio.sleep(0.05)
        assert not quiet.done() and not h.tree.idle
        reads.open()
        await asyncio.wait_for(quiet, 2.0)
        assert h.tree.idle and not h.tree.prefetcher.running
        assert h.tree.prefetcher.inserted_tokens["r"] == len(SEQ)  # applied, not only read


async def test_quiesce_gives_up_with_a_timeout_error_when_l3_is_stuck(
    gated_writes: tuple[Harness, Gate],
) -> None:
    h, writes = gated_writes
    h.run_request("a", SEQ)
    with pytest.raises(TimeoutError, match="did not settle"):
        await h.tree.quiesce(0.2)
    writes.open()
    await h.tree.quiesce(5.0)


async def test_drain_returns_when_the_last_write_lands(gated_writes: tuple[Harness, Gate]) -> None:
    h, writes = gated_writes
    h.run_request("a", SEQ)
    await until(lambda: writes.waiting == 1)
    assert not await h.controller.storage.drain(0.1)  # stuck: reports it, does not hang
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, writes.open)
    started = loop.time()
    assert await h.controller.storage.drain(30.0)
    assert loop.time() - started < 2.0
