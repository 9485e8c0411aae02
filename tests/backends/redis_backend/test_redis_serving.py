"""The tiered cache over ``redis://`` end to end: ``hicache serve --l3 redis://...`` generates
what the no-cache run does and reads its pages back from Redis; and a run over a 3-master
cluster that loses a master half-way finishes with the same outputs and the failures counted.

The model and workloads are the serving tests' smallest: each configuration computes for well
under a second on a 2-core CPU. The servers are the session's (conftest.py); the killed master is
started again, empty, before the test ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
from typing import Any

import pytest
from model_kit import PAGE, VOCAB, tiny_model
from redis_kit import wait_cluster_ok

from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.request import ServeRequest
from hicache.serving.setup import open_engine
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig, TierConfig
from hicache.tiering.common.policies import PrefetchStopPolicy, WritePolicy
from hicache.tools.cli import main
from hicache.tools.services.redis import RedisCluster, RedisServer
from hicache.workloads.synthetic import ChatConfig, MultiTurnChat

# 4 clients x 2 rounds of chat on a 2-layer model: a working set (208 tokens) past the device
# pool (128), so pages go to host and on to L3.
TINY = [
    "--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
    "--vocab", str(VOCAB), "--page-size", str(PAGE), "--clients", "4", "--rounds", "2",
    "--system-tokens", "32", "--turn-tokens", "16", "--output-tokens", "2",
    "--device-tokens", "128", "--host-pages", "48", "--prefetch-threshold", "8",
    "--max-running", "2", "--device", "cpu", "--json", "-q",
]  # fmt: skip
REQUESTS = 4 * 2


def _serve(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    """``hicache serve`` in this process with the tiny flags and ``extra``: its JSON."""
    code = main(["serve", *TINY, *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    result: dict[str, Any] = json.loads(out)
    return result


def _row(result: dict[str, Any], name: str = "device+host+l3") -> dict[str, Any]:
    row: dict[str, Any] = next(r for r in result["configs"] if r["name"] == name)
    return row


def _stored(server: RedisServer, prefix: str) -> int:
    """Keys under ``prefix`` on ``server``, counted by ``redis-cli --scan``."""
    return len(server.cli("--scan", "--pattern", f"{prefix}*").split())


@pytest.mark.slow
def test_serve_over_redis_keeps_outputs_and_reads_pages_back(
    single_server: RedisServer, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    url = single_server.url(key_prefix="serve-warm:")
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    # --l3-warm: the model's shared namespace, so the second process reads the first's pages.
    result = _serve(capsys, "--l3", url, "--compare", "--l3-warm", "--dump-outputs", str(first))
    assert result["outputs_identical"] is True and result["l3"] == url
    l3 = _row(result)
    assert l3["requests"] == REQUESTS and l3["failed"] == 0
    assert l3["bytes_host_to_l3"] > 0 and l3["errors"] == l3["l3_write_failures"] == 0
    assert _stored(single_server, "serve-warm:") > 0, "the pages are in Redis"
    # A new process: device and host start empty, so whatever it reuses comes from Redis.
    again = _serve(
        capsys, "--l3", url, "--l3-warm", "--no-prefetch-skip", "--prefetch-policy",
        "wait_complete", "--dump-outputs", str(second),
    )  # fmt: skip
    warm = _row(again)
    assert warm["hit_tokens_l3"] > 0 and warm["bytes_l3_to_host"] > 0
    assert warm["errors"] == warm["corrupt_pages"] == 0
    assert second.read_text() == first.read_text()  # the no-cache run's tokens, as compared


def test_a_run_of_its_own_leaves_no_pages_in_redis(
    single_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --l3-warm a run writes under a namespace of its own and deletes it at close."""
    url = single_server.url(key_prefix="serve-own:")
    l3 = _row(_serve(capsys, "--l3", url))
    assert l3["bytes_host_to_l3"] > 0 and l3["l3_discarded_objects"] > 0
    assert _stored(single_server, "serve-own:") == 0


# ----- a cluster master killed mid-run ----------------------------------------------------------
CHAT = ChatConfig(
    clients=6, rounds=2, system_tokens=32, turn_tokens=16, output_tokens=2, vocab=VOCAB
)
ENGINE = EngineConfig(max_running=2, skip_slow_prefetch=False, stall_s=20.0)


class _KillHalfWay(MultiTurnChat):
    """The chat, keeping what each request generated; with a ``cluster``, its third master is
    killed at the first request to finish once round 0 (half the requests) has and every
    master holds pages (L3 writes trail the requests: on a loaded machine none may have
    landed when round 0 ends), and what each master held then is counted first."""

    def __init__(self, cluster: RedisCluster | None, prefix: str) -> None:
        super().__init__(CHAT)
        self.cluster = cluster
        self.prefix = prefix
        self.outputs: dict[str, list[int]] = {}
        self.at_kill: list[int] = []

    def finished(self, request: ServeRequest, now: float) -> None:
        if request.record.error is None:
            self.outputs[request.rid] = list(request.generated)
        super().finished(request, now)
        if self.cluster is None or self.at_kill or len(self.outputs) < CHAT.clients:
            return
        held = [_stored(node, self.prefix) for node in self.cluster.nodes]
        if all(held) or len(self.outputs) == CHAT.clients * CHAT.rounds - 1:
            self.at_kill = held  # the test fails on a master that held nothing
            self.cluster.nodes[2].kill()


async def _chat(mode: CacheMode, url: str | None, source: _KillHalfWay) -> dict[str, Any]:
    """``source`` served in ``mode``: the requests' records, the cache's counters and L3's."""
    config = HiCacheConfig(
        tiers=TierConfig(write_policy=WritePolicy.WRITE_THROUGH, write_threshold=1, host_pages=24),
        prefetch=PrefetchConfig(stop_policy=PrefetchStopPolicy.WAIT_COMPLETE, threshold_tokens=8),
        storage=StorageConfig(url=url, required=True),
    )
    setup = await open_engine(tiny_model(ModelPreset.DENSE), mode, config, 128, ENGINE)
    try:
        records = await asyncio.wait_for(setup.engine.run(source), 60.0)
        if setup.cache is not None:
            await setup.cache.quiesce(30.0)
        l3 = await setup.l3_stats()
    finally:
        await setup.close()
    metrics = setup.cache.metrics.as_dict() if setup.cache is not None else {}
    return {"records": records, "metrics": metrics, "l3": l3}


@pytest.mark.slow
async def test_a_cluster_master_killed_mid_run_costs_misses_not_outputs(
    cluster: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    want = _KillHalfWay(None, "")
    await _chat(CacheMode.NONE, None, want)
    prefix = "serve-kill:"
    got = _KillHalfWay(cluster, prefix)
    caplog.set_level(logging.INFO, logger="hicache.backends.redis")
    try:
        run = await _chat(CacheMode.DEVICE_HOST_L3, cluster.url(key_prefix=prefix, timeout=1), got)
    finally:  # back, empty, for the other tests on this cluster
        cluster.nodes[2].start()
        wait_cluster_ok(cluster)
    assert [r.error for r in run["records"] if r.error is not None] == []
    assert got.outputs == want.outputs and len(got.outputs) == CHAT.clients * CHAT.rounds
    # Killed mid-run: every master held pages then.
    assert len(got.at_kill) == 3 and all(got.at_kill), got.at_kill
    # The dead master's pages failed, counted by the backend and by the cache...
    assert run["l3"]["errors"] > 0 and run["metrics"]["l3_write_failures"] > 0
    # ... and the others went on storing the pages that hash to them.
    after = [_stored(node, prefix) for node in cluster.nodes[:2]]
    assert after[0] > got.at_kill[0] and after[1] > got.at_kill[1], (got.at_kill, after)
    # One outage, one warning, naming the master; the others answering did not end it.
    said = [r for r in caplog.records if r.name.startswith("hicache.backends.redis")]
    warned = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    assert len(warned) == 1 and cluster.nodes[2].address in warned[0], warned
    assert not [r for r in said if "answers again" in r.getMessage()]
