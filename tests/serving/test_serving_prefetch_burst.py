"""A burst of returning conversations whose histories are only in L3, with little host memory.

Every request prefetches when it arrives, but they run one at a time: the pages prefetched for
the last ones must still be on host when their turn comes (reserved for them), and a prefetch
that found no host room then reads its pages once room frees. Every history is an L3 hit, and
the tokens are those of the run without a cache.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from serving_kit import ENGINE, VOCAB, assert_same_run, hicache_config, serve, trace

from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode
from hicache.serving.engine_events import RequestAdmitted
from hicache.serving.request import ServeRequest, StepRecord
from hicache.serving.setup import ServingSetup

DENSE = ModelPreset.DENSE
HISTORY = 64  # tokens of each conversation's first turn: 16 pages
ONE_AT_A_TIME = dataclasses.replace(ENGINE, max_running=1)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def unreserved(setup: ServingSetup) -> None:
    """Prefetches that keep nothing for their request: the behaviour before reservations."""
    assert setup.cache is not None
    prefetcher = setup.cache.prefetcher
    start = prefetcher.start
    prefetcher.start = lambda rid, key, match, reserve=False, urgent=False, whole=False: start(  # type: ignore[method-assign]
        rid, key, match, urgent=urgent, whole=whole
    )


async def test_a_burst_reads_every_history_back_from_l3(tmp_path: pathlib.Path) -> None:
    histories = [tokens(10 + i, HISTORY) for i in range(8)]
    prompts = [h + tokens(100 + i, 8) for i, h in enumerate(histories)]
    first = await serve(DENSE, CacheMode.DEVICE_HOST_L3, trace(histories), hicache_config(tmp_path))
    assert not first.errors and first.metrics["pages_written_l3"] >= 8 * HISTORY // 4
    # A restart over that L3 with host room for 3 histories (prefetches may hold half of it).
    small = hicache_config(tmp_path, host_pages=48)
    want = await serve(DENSE, CacheMode.NONE, trace(prompts), engine=ONE_AT_A_TIME)
    got = await serve(DENSE, CacheMode.DEVICE_HOST_L3, trace(prompts), small, engine=ONE_AT_A_TIME)
    assert_same_run(got, want, "burst over L3")
    assert got.hits("l3") == 8 * HISTORY, [(r.rid, r.hit_l3) for r in got.records]
    assert got.metrics["prefetch_no_host_memory"] + got.metrics["prefetch_skipped_capacity"] > 0
    before = await serve(
        DENSE, CacheMode.DEVICE_HOST_L3, trace(prompts), small, engine=ONE_AT_A_TIME,
        watch=unreserved,
    )  # fmt: skip
    # Without reservations, prefetched pages are evicted before their request runs: its history
    # is then either lost (fewer L3 hits) or read from L3 again (more bytes for the same hits),
    # depending on how the run's timing falls.
    reserved_bytes = got.metrics["bytes_l3_to_host"]
    assert before.hits("l3") < got.hits("l3") or before.metrics["bytes_l3_to_host"] > reserved_bytes


async def test_a_request_reads_its_history_while_the_one_before_it_runs(
    tmp_path: pathlib.Path,
) -> None:
    """A request whose arrival prefetch found no host room reads its pages back during the
    steps of the request before it (read ahead): that read starts in the round that admits the
    request before it, not once its own turn has come (a turn still reads what the read ahead
    found no room for), and every history is still an L3 hit."""
    histories = [tokens(10 + i, HISTORY) for i in range(8)]
    prompts = [h + tokens(100 + i, 8) for i, h in enumerate(histories)]
    await serve(DENSE, CacheMode.DEVICE_HOST_L3, trace(histories), hicache_config(tmp_path))
    steps: list[object] = []
    admitted: list[tuple[ServeRequest, int]] = []  # each admitted request, steps before it
    reads: dict[str, list[int]] = {}  # rid -> steps before each of its prefetches started

    def record(setup: ServingSetup) -> None:
        engine, prefetcher = setup.engine, setup.cache.prefetcher  # type: ignore[union-attr]
        prefetch = prefetcher.start
        engine.observe(steps.append, StepRecord)
        engine.observe(lambda event: admitted.append((event.request, len(steps))), RequestAdmitted)

        def prefetching(rid: str, *args: object, **kwargs: object) -> bool:
            started: bool = prefetch(rid, *args, **kwargs)  # type: ignore[arg-type]
            if started:
                reads.setdefault(rid, []).append(len(steps))
            return started

        prefetcher.start = prefetching  # type: ignore[method-assign]

    small = hicache_config(tmp_path, host_pages=48)
    want = await serve(DENSE, CacheMode.NONE, trace(prompts), engine=ONE_AT_A_TIME)
    got = await serve(
        DENSE, CacheMode.DEVICE_HOST_L3, trace(prompts), small, engine=ONE_AT_A_TIME,
        watch=record,
    )  # fmt: skip
    assert_same_run(got, want, "burst over L3, read ahead")
    assert got.hits("l3") == 8 * HISTORY, [(r.rid, r.hit_l3) for r in got.records]
    ahead = [
        (request.rid, reads[request.rid], before_steps)
        for (request, _), (_, before_steps) in zip(admitted[1:], admitted, strict=False)
        if request.read_ahead
    ]
    assert ahead, "no request read its pages back before its turn"
    assert any(before in starts for _, starts, before in ahead), ahead
