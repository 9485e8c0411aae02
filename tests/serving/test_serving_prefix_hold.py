"""The engine holds back a request whose uncached prefix a request in flight is computing.

A burst of requests sharing a long prefix then computes it once, as a sequential oracle would,
and generates the same tokens as the run without a cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from serving_kit import (
    PAGE,
    VOCAB,
    RunResult,
    assert_same_run,
    hicache_config,
    serve,
    tiny_model,
    trace,
)

from hicache.models.config import ModelPreset
from hicache.radix.lifecycle import CachedRequest
from hicache.scheduling.scheduler import PrefixScheduler, SchedulerConfig
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.request import RequestState, ServeRequest
from hicache.serving.setup import ServingSetup, open_engine
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.report import oracle_hit_rate, summarize
from hicache.workloads.synthetic import ChatConfig, burst_conversations_trace
from hicache.workloads.traces import TraceRequest

DENSE = ModelPreset.DENSE
# Chunks of 32 tokens: a 64-token prefix takes two steps to compute, so the others wait a round
# with the prefix half committed (32 tokens still to come: the default match threshold).
ENGINE = EngineConfig(max_running=4, chunk_tokens=32, skip_slow_prefetch=False, stall_s=20.0)
DEVICE_TOKENS = 1024  # room for every request at once: only the hold keeps them apart


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def no_hold(setup: ServingSetup) -> None:
    """The engine's scheduler with in-batch sharing off: the behaviour before holds."""
    engine = setup.engine
    config = SchedulerConfig(policy=engine.config.schedule, in_batch_sharing=False)
    engine.scheduler = PrefixScheduler(engine.tree, config)


async def run(prompts: Sequence[list[int]], mode: CacheMode, hold: bool = True) -> RunResult:
    return await serve(
        DENSE, mode, trace(prompts), hicache_config(None), DEVICE_TOKENS, ENGINE,
        watch=None if hold else no_hold,
    )  # fmt: skip


def oracle_computed(result: RunResult) -> int:
    """Prompt tokens a sequential unbounded cache computes, in the run's finishing order."""
    prompts = [(None, result.prompts[rid], result.outputs[rid]) for rid in result.prompts]
    total = sum(len(p) for _, p, _ in prompts)
    return total - round(oracle_hit_rate(prompts, PAGE) * total)


async def test_a_burst_sharing_a_prefix_computes_it_once() -> None:
    shared = tokens(1, 64)
    prompts = [shared + tokens(100 + i, 8) for i in range(6)]
    want = await run(prompts, CacheMode.NONE)
    got = await run(prompts, CacheMode.DEVICE_HOST)
    assert_same_run(got, want, "held burst")
    assert got.computed == oracle_computed(want) == 64 + 6 * 8
    held = {r.rid: r.held_rounds for r in got.records}
    assert held["t0"] == 0 and all(held[f"t{i}"] >= 1 for i in range(1, 6)), held
    row = summarize("held", got.records, 1.0, {})
    assert row["held_requests"] == 5 and row["held_rounds"] == sum(held.values())
    # Without the hold the first four start together and each computes the prefix.
    unheld = await run(prompts, CacheMode.DEVICE_HOST, hold=False)
    assert_same_run(unheld, want, "unheld burst")
    assert unheld.computed >= got.computed + 3 * 64
    assert all(r.held_rounds == 0 for r in unheld.records)


async def test_a_later_turn_hits_all_of_an_earlier_prompt_still_decoding() -> None:
    # The earlier prompt's last chunk is committed when it is computed, not when the request
    # finishes: the later turn, released then, finds all of it cached.
    first = tokens(2, 100)  # chunks of 64: one inside the prompt, one ending it
    later = first + tokens(3, 10)
    requests = [TraceRequest("t0", "", first, [0] * 8), TraceRequest("t1", "", later, [0] * 3)]
    engine = dataclasses.replace(ENGINE, chunk_tokens=64)
    config = hicache_config(None)
    got = await serve(DENSE, CacheMode.DEVICE_HOST, TraceReplay(requests), config, 1024, engine)
    assert not got.errors, got.errors
    records = {r.rid: r for r in got.records}
    assert records["t1"].held_rounds >= 1
    # Held while the first computed its first chunk; then the first prompt's 25 whole pages hit
    # (64 only, had the last chunk waited for the first request to finish).
    assert records["t1"].computed_tokens == 10
    assert records["t1"].admitted_s < records["t0"].finished_s  # while the first decoded


async def test_a_burst_of_conversations_reaches_the_oracle_hit_rate() -> None:
    chat = ChatConfig(
        clients=4, rounds=3, system_tokens=48, system_prompts=2, turn_tokens=(24, 40),
        output_tokens=2, vocab=VOCAB,
    )  # fmt: skip
    prompts = [r.tokens for r in burst_conversations_trace(chat)]
    want = await run(prompts, CacheMode.NONE)
    got = await run(prompts, CacheMode.DEVICE_HOST)
    assert_same_run(got, want, "conversation burst")
    assert got.computed <= oracle_computed(want) + PAGE * len(prompts)
    unheld = await run(prompts, CacheMode.DEVICE_HOST, hold=False)
    assert unheld.computed > got.computed


# ----- admission rounds, driven by hand --------------------------------------------------------
def waiting(rid: str, prompt: list[int]) -> ServeRequest:
    return ServeRequest(rid, prompt, 2)


def prefilling(rid: str, prompt: list[int]) -> ServeRequest:
    """A running request that has computed none of its prompt yet (it holds no slots)."""
    request = ServeRequest(rid, prompt, 2, state=RequestState.RUNNING)
    request.cached = CachedRequest(rid, prompt, 0)
    return request


async def admit_rounds(in_batch_sharing: bool = True) -> list[list[str]]:
    """Who waits after each of four rounds: a holder running; it leaves (finished or
    failed); nothing running and two sharers waiting."""
    setup = await open_engine(tiny_model(DENSE), CacheMode.DEVICE, hicache_config(None), 1024)
    if not in_batch_sharing:
        no_hold(setup)
    engine = setup.engine
    shared = tokens(4, 64)
    holder = prefilling("holder", [*shared, 1, 2])
    queue, running = [waiting("w", [*shared, 3, 4])], [holder]
    left = []
    try:
        engine._admit(queue, running)
        left.append([r.rid for r in queue])
        running.remove(holder)  # it finished or failed without committing the prefix
        engine._admit(queue, running)
        left.append([r.rid for r in queue])
        queue, running = [waiting("a", [*shared, 5]), waiting("b", [*shared, 6])], []
        engine._admit(queue, running)
        left.append([r.rid for r in queue])
        left.append([r.rid for r in running])
    finally:
        await setup.close()
    return left


async def test_held_while_the_holder_runs_released_once_it_is_gone() -> None:
    left = await admit_rounds()
    assert left[0] == ["w"]  # the holder computes its prefix
    assert left[1] == []  # the holder left: nobody covers the prefix, so it goes on
    assert left[2] == ["b"] and left[3] == ["a"]  # nothing ran: the first went, not both


async def test_in_batch_sharing_off_holds_nothing() -> None:
    left = await admit_rounds(in_batch_sharing=False)
    assert left[0] == [] and left[2] == [] and left[3] == ["a", "b"]


async def test_the_prefill_delayer_holds_a_burst_and_changes_no_token() -> None:
    shared = tokens(7, 64)
    prompts = [shared + tokens(200 + i, 8) for i in range(6)]
    want = await run(prompts, CacheMode.NONE)
    seen: list[ServingSetup] = []
    engine = dataclasses.replace(ENGINE, delay_prefill=True)
    got = await serve(
        DENSE, CacheMode.DEVICE_HOST, trace(prompts), hicache_config(None), DEVICE_TOKENS, engine,
        watch=seen.append,
    )  # fmt: skip
    assert_same_run(got, want, "delayed burst")
    delayer = seen[0].engine.delayer
    assert delayer is not None and delayer.delayed_rounds > 0  # held while the queue shared
    assert delayer.hit_rate > 0  # and learned from what it admitted
