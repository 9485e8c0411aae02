"""HiSparse on the ``dsv4`` preset: a decoding request's C4 entries live in host memory (its
indexer keys in the buffer's device slots) and only the pages of each query's top-k entries
come to its device hot buffer; its window (``swa``) and C128 entries stay on the device as
without HiSparse. The outputs and logits are those of the no-cache run; the device holds no C4
of a decoding request beyond its buffer; an ``--index-topk`` whose pages cannot fit
``--hot-pages`` is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
from typing import Any

import pytest
import torch
from cli_kit import run
from follow_up_kit import FollowUp
from serving_kit import Recording, RunResult, _capture_logits, assert_same_run, keep_setups
from test_serving_cli_errors import one_line_error
from test_serving_dsv4 import CHAT as DSV4_CHAT
from test_serving_dsv4 import CONFIG, DEVICE_TOKENS, ENGINE, ONE, PAGE, SMALL, _hicache, model

from hicache.errors import ConfigError
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.engine_events import ChunkPlanned, StepStarted
from hicache.serving.setup import ServingSetup, open_engine
from hicache.sparse.hot_buffer import HiSparseConfig
from hicache.tiering.common.config import HiCacheConfig
from hicache.workloads.synthetic import MultiTurnChat

TOPK = CONFIG.index_topk_pages  # C4 entries a query picks
# The dsv4 tests' chat, with a few groups of 4 completed while decoding from the buffer.
CHAT = dataclasses.replace(DSV4_CHAT, output_tokens=14, vocab=CONFIG.vocab_size)


def _engine(hot_pages: int | None) -> EngineConfig:
    hisparse = None if hot_pages is None else HiSparseConfig(hot_pages=hot_pages)
    return dataclasses.replace(ENGINE, hisparse=hisparse)


def _config(l3_dir: pathlib.Path | None) -> HiCacheConfig:
    base = _hicache(l3_dir)
    return dataclasses.replace(base, tiers=dataclasses.replace(base.tiers, host_pages=48))


@dataclasses.dataclass
class _Run:
    result: RunResult
    # per step: the C4 slots running requests held, and whether every chunk decoded from the
    # hot buffer
    steps: list[tuple[int, bool]]
    setup: ServingSetup


async def _serve(mode: CacheMode, hot_pages: int | None, l3: pathlib.Path | None = None) -> _Run:
    recording = Recording(MultiTurnChat(CHAT))
    setup = await open_engine(model(), mode, _config(l3), DEVICE_TOKENS, _engine(hot_pages))
    logits: dict[tuple[str, int], torch.Tensor] = {}
    _capture_logits(setup, logits)
    started: list[tuple[int, bool] | None] = []
    setup.engine.observe(lambda _: started.append(None), StepStarted)

    def planned(event: ChunkPlanned) -> None:  # after the step's requests entered the buffer
        hot = event.chunk.hot_row is not None
        last = started[-1]
        started[-1] = (_c4_held(setup), hot if last is None else last[1] and hot)

    setup.engine.observe(planned, ChunkPlanned)
    try:
        records = await asyncio.wait_for(setup.engine.run(recording), 120.0)
    finally:
        await setup.close()
    metrics = setup.cache.metrics.as_dict() if setup.cache is not None else {}
    result = RunResult(recording.outputs, records, metrics, recording.prompts, logits)
    steps = [step for step in started if step is not None]  # steps that ran chunks
    return _Run(result, steps, setup)


def _c4_held(setup: ServingSetup) -> int:
    """C4 slots that neither the free list nor the tree's evictable cache has: the ones
    running requests hold."""
    c4 = setup.engine.pools["c4"]
    tree = setup.cache
    evictable = tree.evictable_size if tree is not None else 0
    return c4.size - c4.available_size - evictable


@pytest.mark.parametrize("hot_pages", [TOPK + 1, 4 * TOPK], ids=["tight", "roomy"])
async def test_outputs_identical_with_and_without_hisparse(
    hot_pages: int, tmp_path: pathlib.Path
) -> None:
    want = (await _serve(CacheMode.NONE, None)).result
    assert len(want.outputs) == CHAT.clients * CHAT.rounds and not want.errors
    for mode, l3 in ((CacheMode.DEVICE_HOST, None), (CacheMode.DEVICE_HOST_L3, tmp_path / "l3")):
        got = await _serve(mode, hot_pages, l3)
        assert_same_run(got.result, want, f"{mode.value} --hisparse")
        sparse = got.setup.engine.sparse
        assert sparse is not None
        stats = sparse.buffer.stats
        decodes = sum(len(out) - 1 for out in want.outputs.values())
        assert stats.decode_rows == decodes > 0, stats
        assert 0 < stats.missed_pages <= stats.wanted_pages, stats
        assert sparse.buffer.free_rows == ENGINE.max_running  # every row given back
        assert sparse.buffer.index_slots.available_size == sparse.buffer.index_slots.size
        assert got.setup.cache is not None and got.setup.cache.host.protected_pages == 0


async def test_decoding_requests_hold_no_c4_beyond_the_buffer() -> None:
    """While every running request decodes from the buffer, none holds a C4 slot of the device
    pool (its prompt's stay in the tree as evictable cache): its C4 on the device is its buffer
    row, whose size is set by ``--hot-pages``, not by the context. Without HiSparse a decoding
    request holds a slot per token of its context."""
    hot_pages = TOPK + 1
    got = await _serve(CacheMode.DEVICE_HOST, hot_pages)
    decoding = [held for held, hot in got.steps if hot]
    assert len(decoding) > CHAT.output_tokens  # steps where every chunk was a buffer decode
    assert max(decoding) == 0, got.steps
    plain = await _serve(CacheMode.DEVICE_HOST, None)
    longest = max(len(p) for p in plain.result.prompts.values())
    assert max(held for held, _ in plain.steps) >= longest

    sparse = got.setup.engine.sparse
    assert sparse is not None
    layers = CONFIG.pools().pool("c4").layout.layers
    rows = ENGINE.max_running  # and a spare page for the masked copies' non-misses (CUDA)
    shape = (layers, rows * hot_pages + 1, PAGE, CONFIG.c4_dim // 4)
    assert tuple(sparse.buffer.latent.shape) == shape


def test_cli_refuses_a_topk_the_buffer_cannot_hold(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    """4 entries may lie on 4 pages, and the page the new entry goes to makes 5."""
    flags = [*SMALL, *ONE, "--page-size", "128", "--device-tokens", "1024", "--hisparse"]
    argv = ["--index-topk", "4", "--hot-pages", "4", "--cache-dir", str(tmp_path / "l3")]
    code, out, err = run(capsys, *flags, *argv)
    assert code == 2 and out == "", err
    line = one_line_error(err)
    assert "--hot-pages" in line and "--index-topk" in line, line
    assert not (tmp_path / "l3").exists()


def test_check_counts_the_own_page_and_the_pages_a_context_has() -> None:
    HiSparseConfig(hot_pages=TOPK + 1).check(CONFIG, DEVICE_TOKENS)  # top-k pages and its own
    with pytest.raises(ConfigError, match="--hot-pages"):
        HiSparseConfig(hot_pages=TOPK).check(CONFIG, DEVICE_TOKENS)
    # The seed's top-512 entries: a context of the device's 8 pages has no more pages than that
    # (C128 holds every token on the device, so no context is longer).
    seed = dataclasses.replace(CONFIG, index_topk_pages=512)
    pages = DEVICE_TOKENS // PAGE
    HiSparseConfig(hot_pages=pages).check(seed, DEVICE_TOKENS)
    with pytest.raises(ConfigError, match="--index-topk"):
        HiSparseConfig(hot_pages=pages - 1).check(seed, DEVICE_TOKENS)


def test_cli_compare_with_hisparse_and_the_seeds_topk_is_identical(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compare`` with the default ``--index-topk`` (512 entries, more than a context has):
    the host tiers decode from the buffer, and every configuration gives the same tokens."""
    setups = keep_setups(monkeypatch)
    argv = [
        *SMALL, "--page-size", "128", "--device-tokens", "1024", "--clients", "2",
        "--rounds", "2", "--system-tokens", "256", "--turn-tokens", "64", "--output-tokens", "9",
        "--hisparse", "--hot-pages", "8", "--cache-dir", str(tmp_path), "--json", "--compare",
    ]  # fmt: skip
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    result = json.loads(out)
    assert result["outputs_identical"] is True
    assert all(r["failed"] == 0 for r in result["configs"])
    assert [s.engine.sparse is not None for s in setups] == [False, False, True, True]
    for setup in setups[2:]:
        sparse = setup.engine.sparse
        assert sparse is not None and sparse.buffer.stats.decode_rows > 0


FIRST_PROMPT, FIRST_OUTPUT = 200, 70  # the output completes the second page (256 tokens)


async def _follow_up(mode: CacheMode, hot_pages: int | None, l3: pathlib.Path | None) -> Any:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, CONFIG.vocab_size, (FIRST_PROMPT,), generator=gen).tolist()
    question = torch.randint(0, CONFIG.vocab_size, (20,), generator=gen).tolist()
    source = FollowUp(prompt, question, FIRST_OUTPUT)
    setup = await open_engine(model(), mode, _config(l3), DEVICE_TOKENS, _engine(hot_pages))
    try:
        records = {r.rid: r for r in await setup.engine.run(source)}
    finally:
        await setup.close()
    return source, records, setup


@pytest.mark.parametrize("with_l3", [False, True], ids=["device+host", "device+host+l3"])
async def test_a_follow_up_hits_the_output_decoded_from_the_buffer(
    with_l3: bool, tmp_path: pathlib.Path
) -> None:
    """The first turn decodes its output from the buffer (its C4 entries on host only); at
    finish its whole pages hang in the tree with host copies of C128 and of the last window, so
    the follow-up hits every whole page of the conversation, computes only the rest, and
    generates what it generates on a cold cache."""
    mode = CacheMode.DEVICE_HOST_L3 if with_l3 else CacheMode.DEVICE_HOST
    source, records, setup = await _follow_up(mode, TOPK + 1, tmp_path / "l3" if with_l3 else None)
    first, second = source.done["turn1"], source.done["turn2"]
    assert len(first.generated) == FIRST_OUTPUT
    whole = (FIRST_PROMPT + FIRST_OUTPUT - 1) // PAGE * PAGE
    prompt_pages = FIRST_PROMPT // PAGE * PAGE
    assert whole > prompt_pages  # a whole page that only decoding computed
    follow = records["turn2"]
    assert follow.hit_device + follow.hit_host + follow.hit_l3 == whole, follow
    assert follow.hit_host >= whole - prompt_pages, follow  # the output lived on host only
    assert follow.computed_tokens == len(second.prompt) - whole
    tree = setup.cache
    assert tree is not None and tree.host.protected_pages == 0
    sparse = setup.engine.sparse
    assert sparse is not None and sparse.buffer.stats.decode_rows >= FIRST_OUTPUT - 1

    cold, cold_records, _ = await _follow_up(CacheMode.NONE, None, None)
    assert cold_records["turn1"].computed_tokens == FIRST_PROMPT
    assert cold.done["turn1"].generated == first.generated
    assert cold.done["turn2"].generated == second.generated
