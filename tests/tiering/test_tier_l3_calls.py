"""How the storage tier ends and reports its L3 calls: a stalled call cut by its deadline is
waited for, not abandoned, when the tier stops; a failing L3 is counted on every call but
logged only now and then."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from gated_kit import seed_l3, start_prefetch, tokens, until
from tier_kit import Harness

from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import (
    FaultConfig,
    FaultInjectionBackend,
    FaultMode,
    Operation,
    WrapperBackend,
)
from hicache.tiering.common.config import StorageConfig
from hicache.tiering.l3.failure_log import FailureLog

SEQ = tokens(1, 8)
TIER_LOGGER = "hicache.tiering.l3.storage_tier"


class StalledReads(WrapperBackend):
    """Once ``stalling``, ``get_into`` never returns. Cancelled, it takes a while to unwind,
    as a call waiting for its I/O thread does (see ``outlive_cancel``)."""

    name = "stalled-reads"

    def __init__(self) -> None:
        super().__init__(MemoryBackend())
        self.stalling = False
        self.unwound = False

    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
        if not self.stalling:
            return await self.inner.get_into(keys, buffers)
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.05)
            self.unwound = True
        raise AssertionError("unreachable: the event is never set")


async def test_a_stalled_read_past_its_deadline_has_ended_once_the_tier_is_closed() -> None:
    backend = StalledReads()
    async with await Harness.build(backend=backend, storage=StorageConfig(op_deadline_s=0.05)) as h:
        await seed_l3(h, SEQ)
        backend.stalling = True
        prefetch = start_prefetch(h, "r", SEQ)
        await until(lambda: h.controller.metrics.counts["timeouts"] == 1)
        assert not prefetch.reads_finished  # the late read still holds its host pages
    # Closing cancelled the read and waited for it: no task is left for the loop to destroy
    # ("Task was destroyed but it is pending") and the read is no longer filling host pages.
    assert backend.unwound
    assert asyncio.all_tasks() == {asyncio.current_task()}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == TIER_LOGGER and r.levelno >= logging.WARNING
    ]


async def test_a_failing_l3_is_counted_on_every_call_and_logged_a_few_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    faults = FaultConfig(
        operations=frozenset({Operation.EXISTS}), fail_rate=1.0, fail_mode=FaultMode.RAISE
    )
    backend = FaultInjectionBackend(MemoryBackend(), faults)
    h = await Harness.build(backend=backend)
    caplog.set_level(logging.WARNING, logger=TIER_LOGGER)
    try:
        for _ in range(1000):
            assert await h.controller.storage._bounded(backend.exists(["k"]), None) is None
        assert h.controller.metrics.counts["errors"] == 1000
        during = _warnings(caplog)
        assert 1 <= len(during) <= 2  # the first failure; a summary only if 10 s went by
        assert during[0].startswith("L3 call failed: BackendUnavailableError: ")
    finally:
        await h.close()
    logged = _warnings(caplog)  # closing logs the summary still owed
    assert len(logged) <= 3
    assert sum(int(n) for m in logged for n in re.findall(r"failed (\d+) more", m)) == 999


def test_the_failure_log_summarises_once_per_interval() -> None:
    now = [0.0]
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logger = logging.getLogger("test.failure_log")
    handler = Collect()
    logger.addHandler(handler)
    log = FailureLog(logger, "call failed", interval_s=10.0, clock=lambda: now[0])
    try:
        for i in range(300):  # three failures a second for 100 s, of two kinds
            now[0] = i / 3
            log.failed(OSError("disk") if i % 2 else TimeoutError("slow"))
        log.flush()
        owed = len(records)
        log.flush()  # nothing owed: nothing logged
    finally:
        logger.removeHandler(handler)
    assert records[:2] == ["call failed: TimeoutError: slow", "call failed: OSError: disk"]
    counts = [int(m.split()[2]) for m in records[2:]]
    assert 9 <= len(counts) <= 11 and sum(counts) == 298
    assert all(m.startswith("call failed ") and "(last: " in m for m in records[2:])
    assert len(records) == owed
