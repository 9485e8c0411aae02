"""``stats``: one report, or a watch with rates, on an injected clock."""

from __future__ import annotations

import io
import json

import pytest

from hicache.backends.memory import MemoryBackend
from hicache.errors import InvalidArgumentError
from hicache.tools.store.stats import StatsOptions, watch_stats


async def test_once_as_a_table() -> None:
    backend = MemoryBackend()
    assert await backend.put(["k"], [b"v" * 10]) == [True]
    out = io.StringIO()
    assert await watch_stats(backend, StatsOptions(), out) == 1
    rows = dict(line.split() for line in out.getvalue().splitlines() if line)
    assert rows["puts"] == "1" and rows["bytes_written"] == "10" and rows["objects"] == "1"


async def test_watch_reports_rates_of_what_changed() -> None:
    backend = MemoryBackend()
    now = [100.0]
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds
        n = len(sleeps)
        assert await backend.put([f"k{n}"], [b"x" * 100 * n]) == [True]  # work between reports

    out = io.StringIO()
    options = StatsOptions(watch_s=2.0, count=3, as_json=True)
    assert await watch_stats(backend, options, out, sleep=sleep, clock=lambda: now[0]) == 3
    reports = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sleeps == [2.0, 2.0]
    assert "rates" not in reports[0]
    assert reports[1]["rates"] == {
        "puts": 0.5,
        "bytes_written": 50.0,
        "objects": 0.5,
        "used_bytes": 50.0,
    }
    assert reports[2]["rates"]["bytes_written"] == 100.0
    assert reports[2]["stats"]["puts"] == 2


def test_bad_options() -> None:
    with pytest.raises(InvalidArgumentError):
        StatsOptions(watch_s=0)
    with pytest.raises(InvalidArgumentError):
        StatsOptions(watch_s=1, count=0)
