"""``hicache bench backends --backend redis``: the backend against a bare redis-py pipeline on
the same server, put, get and exists, in a small run (its own server, then a given URL)."""

from __future__ import annotations

import pathlib

import pytest

from hicache.tools.bench.stores.backends import BackendBenchConfig, run_backend_bench
from hicache.tools.services.redis import RedisServer


@pytest.mark.asyncio
@pytest.mark.parametrize("given_url", [False, True], ids=["provisioned", "url"])
async def test_a_small_run_reports_every_figure(
    given_url: bool, single_server: RedisServer, tmp_path: pathlib.Path
) -> None:
    url = single_server.url(key_prefix="bench:") if given_url else None
    cfg = BackendBenchConfig(
        backends=("redis",), url=url, objects=40, object_bytes=4096, repeats=3,
        directory=str(tmp_path),
    )  # fmt: skip
    (row,) = await run_backend_bench(cfg)
    assert (row["backend"], row["objects"], row["rounds"]) == ("redis", 40, 3)
    for figure in ("put_gbps", "get_gbps", "exists_kops"):
        assert row[figure] > 0 and row[f"raw_{figure}"] > 0
    for ratio in ("put_ratio", "get_ratio", "exists_ratio"):
        assert 0 < row[f"{ratio}_min"] <= row[ratio] <= row[f"{ratio}_max"]
    assert "put_ratio_blocking" not in row, "an asyncio client has no blocking baseline"
    assert row["exists_cpu_ratio"] > 0
    if given_url:  # the baseline's keys are gone; the backend's stay under its prefix
        assert single_server.cli("--scan", "--pattern", "raw-*") == ""
        assert int(single_server.cli("EVAL", "return #redis.call('KEYS','bench:*')", "0")) == 40
    assert list(tmp_path.iterdir()) == []
