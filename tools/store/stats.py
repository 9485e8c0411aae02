"""``hicache stats URL``: the counters a backend keeps, once or every few seconds (``--watch``).

What there is to see depends on where a backend keeps its counters. ``shm`` keeps them in the
shared segment, so they add up the work of every process attached to it, and a watch shows
rates. ``file`` keeps them per process: from the command line it reports the store's objects
and bytes as found when it was opened, plus the (idle) counters of the command itself; run
``hicache inspect`` for a fresh look at a file store. Process-private stores (``memory://``)
are refused when opened, since another process has nothing to show.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

from hicache.backends.base import StorageBackend
from hicache.errors import InvalidArgumentError

__all__ = ["StatsOptions", "watch_stats"]


@dataclass(frozen=True, slots=True)
class StatsOptions:
    watch_s: float | None = None  # seconds between reports; None: report once
    count: int | None = None  # reports before stopping when watching; None: until interrupted
    as_json: bool = False  # one JSON object per report and line

    def __post_init__(self) -> None:
        if self.watch_s is not None and self.watch_s <= 0:
            raise InvalidArgumentError("--watch needs a positive number of seconds")
        if self.count is not None and self.count <= 0:
            raise InvalidArgumentError("--count must be positive")


def _rates(
    now: dict[str, int | float], before: dict[str, int | float], seconds: float
) -> dict[str, float]:
    return {
        name: round((value - before[name]) / seconds, 3)
        for name, value in now.items()
        if name in before and value != before[name] and seconds > 0
    }


def _write(
    out: TextIO, stats: dict[str, int | float], rates: dict[str, float] | None, as_json: bool
) -> None:
    if as_json:
        report: dict[str, Any] = {"time": round(time.time(), 3), "stats": stats}
        if rates is not None:
            report["rates"] = rates
        out.write(json.dumps(report) + "\n")
    else:
        for name, value in sorted(stats.items()):
            rate = f"  {rates[name]:+,.1f}/s" if rates and name in rates else ""
            out.write(f"{name:<24} {value:>16}{rate}\n")
        out.write("\n")
    out.flush()


async def watch_stats(
    backend: StorageBackend,
    options: StatsOptions,
    out: TextIO,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Write the backend's stats, then, when watching, again each period with rates; the
    number of reports written."""
    before: dict[str, int | float] | None = None
    at = clock()
    reports = 0
    while True:
        stats = await backend.stats()
        now = clock()
        rates = None if before is None else _rates(stats, before, now - at)
        _write(out, stats, rates, options.as_json)
        reports += 1
        if options.watch_s is None or (options.count is not None and reports >= options.count):
            return reports
        before, at = stats, now
        await sleep(options.watch_s)
