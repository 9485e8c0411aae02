"""HiSparse: DSA decode from a per-request device hot buffer over host memory.

Outputs (and logits) are those of a run without it, on every tier with a host pool and after a
restart over L3, with a buffer as small as the top-k and with a larger one; the buffer is really
used (decode rows, misses, exact counts of wanted pages); everything a request holds is given
back; a buffer bigger than the context loads each page once; admission counts the buffer, not
the context; and bad configurations are refused before anything runs.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from cli_kit import run
from serving_kit import (
    DEVICE_TOKENS,
    ENGINE,
    PAGE,
    VOCAB,
    RunResult,
    assert_same_run,
    baseline,
    hicache_config,
    keep_setups,
    model_config,
    serve,
    tiny_model,
    workload,
)
from test_serving_bad_input import CHAT, TINY
from test_serving_cli_errors import one_line_error

from hicache.errors import ConfigError
from hicache.models.config import ModelPreset
from hicache.models.tiny import TinyTransformer
from hicache.models.types import DecodeRows
from hicache.serving.engine import CacheMode, EngineConfig, RequestSource
from hicache.serving.engine_events import StepStarted
from hicache.serving.request import ServeRequest, StepRecord
from hicache.serving.setup import ServingSetup, open_engine
from hicache.sparse.hot_buffer import HiSparseConfig, HotStats
from hicache.tiering.common.config import HiCacheConfig
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.traces import TraceRequest

DSA = ModelPreset.DSA
TOPK = model_config(DSA).index_topk_pages  # 2 pages
LAYERS = model_config(DSA).layers
HOST_TIERS = [CacheMode.DEVICE_HOST, CacheMode.DEVICE_HOST_L3]


def hot_engine(hot_pages: int, base: EngineConfig = ENGINE, index_tokens: int = 0) -> EngineConfig:
    hisparse = HiSparseConfig(hot_pages=hot_pages, index_tokens=index_tokens)
    return dataclasses.replace(base, hisparse=hisparse)


# ----- a serve that keeps what the engine held ---------------------------------------------------
@dataclass(frozen=True)
class Leftovers:
    """What the engine still held after the run (and the cache's close)."""

    free_rows: int
    rows: int
    index_free: int
    index_size: int
    host_protected: int
    host_used: int
    tree_host: int  # host pages the tree's nodes hold


@dataclass
class HotRun:
    result: RunResult
    stats: HotStats | None  # None without HiSparse
    running: list[int]  # len(running) at every step
    left: Leftovers | None  # None without a host tier
    setup: ServingSetup = field(repr=False)


def _count_running(setup: ServingSetup, into: list[int]) -> None:
    setup.engine.observe(lambda started: into.append(started.running), StepStarted)


def _leftovers(setup: ServingSetup) -> Leftovers | None:
    tree = setup.cache
    if tree is None:
        return None
    sparse = setup.engine.sparse
    rows = setup.engine.config.max_running
    free_rows = sparse.buffer.free_rows if sparse is not None else rows
    slots = sparse.buffer.index_slots if sparse is not None else None
    index_free = slots.available_size if slots is not None else 0
    index_size = slots.size if slots is not None else 0
    held = sum(len(n.host_value) for n in tree.all_nodes() if n.host_value is not None)
    host = tree.host
    return Leftovers(
        free_rows, rows, index_free, index_size, host.protected_pages, host.used_pages, held
    )


async def serve_hot(
    mode: CacheMode,
    source: RequestSource,
    config: HiCacheConfig,
    engine: EngineConfig,
    device_tokens: int = DEVICE_TOKENS,
    logits: bool = False,
    watch: Callable[[ServingSetup], None] | None = None,
    model: TinyTransformer | None = None,
) -> HotRun:
    """Serve ``source`` with a fresh engine; keep the hot buffer's stats, the number of running
    requests at every step and what was still held after the cache's close."""
    running: list[int] = []
    setups: list[ServingSetup] = []

    def install(setup: ServingSetup) -> None:
        setups.append(setup)
        _count_running(setup, running)
        if watch is not None:
            watch(setup)

    result = await serve(
        DSA, mode, source, config, device_tokens, engine, logits, model=model, watch=install
    )
    setup = setups[0]
    sparse = setup.engine.sparse
    stats = dataclasses.replace(sparse.buffer.stats) if sparse is not None else None
    return HotRun(result, stats, running, _leftovers(setup), setup)


def assert_given_back(run: HotRun, label: str) -> None:
    """Every row and indexer slot free, no host page protected, and the host pool holds
    exactly the tree's pages (no request's own page leaked)."""
    left = run.left
    assert left is not None
    assert left.free_rows == left.rows, f"{label}: {left}"
    assert left.index_free == left.index_size, f"{label}: {left}"
    assert left.host_protected == 0, f"{label}: {left}"
    assert left.host_used == left.tree_host, f"{label}: {left}"


def _decode_positions(run: RunResult) -> dict[str, range]:
    """Positions of every request's decode tokens: the first output comes from the prefill,
    then each output but the last is fed back at the next position."""
    return {
        rid: range(len(run.prompts[rid]), len(run.prompts[rid]) + len(out) - 1)
        for rid, out in run.outputs.items()
    }


def expected_wanted(run: RunResult) -> int:
    """Top-k pages over every decode row and layer: each token reads min(k, pages so far)."""
    per_layer = sum(
        min(TOPK, p // PAGE + 1) for positions in _decode_positions(run).values() for p in positions
    )
    return LAYERS * per_layer


def assert_hisparse_used(run: HotRun, label: str) -> None:
    stats = run.stats
    assert stats is not None
    decodes = sum(len(p) for p in _decode_positions(run.result).values())
    assert stats.decode_rows == decodes > 0, f"{label}: {stats}"
    assert stats.wanted_pages == expected_wanted(run.result), f"{label}: {stats}"
    assert 0 < stats.missed_pages <= stats.wanted_pages, f"{label}: {stats}"
    sparse = run.setup.engine.sparse
    assert sparse is not None
    page_bytes = PAGE * model_config(DSA).latent_dim * sparse.buffer.host.buffer.element_size()
    assert stats.h2d_bytes == stats.missed_pages * page_bytes, f"{label}: {stats}"


# ----- 1. the same outputs, with the buffer really used ----------------------------------------
@pytest.mark.parametrize("hot_pages", [TOPK, 4 * TOPK], ids=["tight", "roomy"])
async def test_outputs_identical_with_and_without_hisparse(
    hot_pages: int, tmp_path: pathlib.Path
) -> None:
    want = await baseline(DSA)  # no cache, no HiSparse
    engine = hot_engine(hot_pages)
    host = await serve_hot(
        CacheMode.DEVICE_HOST, workload("chat"), hicache_config(None), engine, logits=True
    )
    assert_same_run(host.result, want, "device+host")
    assert_hisparse_used(host, "device+host")
    assert_given_back(host, "device+host")
    assert max(host.running) == ENGINE.max_running  # decoding from the buffer side by side

    config = hicache_config(tmp_path / "l3")
    l3 = await serve_hot(CacheMode.DEVICE_HOST_L3, workload("chat"), config, engine, logits=True)
    assert_same_run(l3.result, want, "device+host+l3")
    assert_hisparse_used(l3, "device+host+l3")
    assert_given_back(l3, "device+host+l3")
    assert l3.result.metrics["pages_written_l3"] > 0

    # A restart over the same L3: the new engine's device and host start empty.
    again = await serve_hot(CacheMode.DEVICE_HOST_L3, workload("chat"), config, engine, logits=True)
    assert_same_run(again.result, want, "after a restart")
    assert_hisparse_used(again, "after a restart")
    assert_given_back(again, "after a restart")
    assert again.result.hits("l3") > 0 and again.result.metrics["bytes_l3_to_host"] > 0


def _host_short_at_every_backup(setup: ServingSetup) -> None:
    """Before each node of an entering request's path is had on host, evict everything host
    eviction may take: the copies the device and L3 also hold go first, so an earlier node of
    the same path is a candidate unless entering protects it."""
    sparse, tree = setup.engine.sparse, setup.cache
    assert sparse is not None and tree is not None
    on_host = sparse._on_host

    def pressed(node: Any) -> bool:
        tree.host_evictor.evict(1 << 30)
        return bool(on_host(node))

    sparse._on_host = pressed  # type: ignore[method-assign]


async def test_entering_keeps_the_host_pages_of_its_path_when_host_memory_is_short(
    tmp_path: pathlib.Path,
) -> None:
    """After a restart over L3 a request's path is on the device and in L3, so its host copies
    are the first host eviction drops. Entering the hot buffer backs each node up in turn:
    an earlier node's pages, freed by a later node's backup and given to it, once showed up
    twice in the request's host table."""
    want = await baseline(DSA)
    engine = hot_engine(TOPK)
    config = hicache_config(tmp_path / "l3")
    first = await serve_hot(CacheMode.DEVICE_HOST_L3, workload("chat"), config, engine)
    assert_same_run(first.result, want, "device+host+l3")
    again = await serve_hot(
        CacheMode.DEVICE_HOST_L3, workload("chat"), config, engine,
        watch=_host_short_at_every_backup,
    )  # fmt: skip
    assert_same_run(again.result, want, "after a restart, host memory short")
    assert_hisparse_used(again, "after a restart, host memory short")
    assert_given_back(again, "after a restart, host memory short")
    assert again.result.metrics["host_evicted_tokens"] > 0


async def test_chunked_prefill_then_hot_decode_is_identical() -> None:
    """Prompts computed over several steps (chunks of 5 tokens, across page boundaries) beside
    other requests' decode rows; each moves to the buffer once its prompt is done."""
    want = await baseline(DSA)
    chunk = 5
    engine = hot_engine(TOPK, dataclasses.replace(ENGINE, chunk_tokens=chunk))
    steps: list[StepRecord] = []

    def watch(setup: ServingSetup) -> None:
        setup.engine.observe(steps.append, StepRecord)

    got = await serve_hot(
        CacheMode.DEVICE_HOST,
        workload("chat"),
        hicache_config(None),
        engine,
        logits=True,
        watch=watch,
    )
    assert_same_run(got.result, want, "chunked prefill")
    assert_hisparse_used(got, "chunked prefill")
    assert_given_back(got, "chunked prefill")
    assert max(s.prefill_tokens for s in steps) <= chunk * ENGINE.max_running
    assert any(s.prefill_tokens and s.decode_tokens for s in steps)  # mixed steps


async def test_a_buffer_as_small_as_the_topk_misses_more() -> None:
    """The buffer is what the decode reads: the tight one (every wanted page fills it) has to
    reload pages the roomy one keeps."""
    runs = {}
    for hot_pages in (TOPK, 64):
        runs[hot_pages] = await serve_hot(
            CacheMode.DEVICE_HOST, workload("chat"), hicache_config(None), hot_engine(hot_pages)
        )
    tight, roomy = runs[TOPK].stats, runs[64].stats
    assert tight is not None and roomy is not None
    assert runs[TOPK].result.outputs == runs[64].result.outputs
    assert tight.wanted_pages == roomy.wanted_pages
    assert tight.missed_pages > roomy.missed_pages
    assert tight.miss_rate > roomy.miss_rate > 0


# ----- 3. a buffer bigger than the context loads each page once --------------------------------
def _at_once(requests: Sequence[tuple[int, int]], seed: int = 11) -> TraceReplay:
    """Requests of (prompt tokens, output tokens), all arriving at once."""
    gen = torch.Generator().manual_seed(seed)
    return TraceReplay(
        [
            TraceRequest(
                f"r{i}", "", torch.randint(0, VOCAB, (n,), generator=gen).tolist(), [0] * m
            )
            for i, (n, m) in enumerate(requests)
        ]
    )


async def test_contexts_within_the_topk_load_every_page_once() -> None:
    """Every context fits in the top-k, so every page is wanted at every step from the first
    step it exists in: each (request, layer) misses each of its pages exactly once."""
    shapes = [(1, 2), (2, 2), (3, 4), (4, 3), (5, 2), (6, 3), (PAGE, 5)]
    assert all(-(-(n + m - 1) // PAGE) <= TOPK for n, m in shapes)  # context at the last step
    got = await serve_hot(
        CacheMode.DEVICE_HOST, _at_once(shapes), hicache_config(None), hot_engine(2 * TOPK)
    )
    assert not got.result.errors and len(got.result.outputs) == len(shapes)
    pages = sum(positions[-1] // PAGE + 1 for positions in _decode_positions(got.result).values())
    assert got.stats is not None
    assert got.stats.missed_pages == LAYERS * pages
    assert got.stats.wanted_pages == expected_wanted(got.result) > got.stats.missed_pages
    assert_given_back(got, "short contexts")


class WantedPages:
    """Which pages each request wanted in each layer (the ``top`` the buffer is asked for)."""

    def __init__(self) -> None:
        self.by_request: dict[tuple[str, int], set[int]] = {}
        self._row_owner: dict[int, str] = {}

    def install(self, setup: ServingSetup) -> None:
        sparse = setup.engine.sparse
        assert sparse is not None
        enter, gather = sparse.enter, sparse.buffer.start_gather

        def entering(request: ServeRequest, commit: Any) -> str | None:
            self._row_owner[request.hot.row] = request.rid
            return enter(request, commit)

        def gathering(
            layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
        ) -> Callable[[], torch.Tensor]:
            assert rows.hot_rows is not None
            for row, pages in zip(rows.hot_rows.tolist(), top.tolist(), strict=True):
                key = (self._row_owner[row], layer)
                self.by_request.setdefault(key, set()).update(p for p in pages if p >= 0)
            return gather(layer, rows, top, latent_new)

        sparse.enter = entering  # type: ignore[method-assign]
        sparse.buffer.start_gather = gathering  # type: ignore[method-assign]


async def test_a_buffer_bigger_than_any_context_never_reloads_a_page() -> None:
    """Contexts longer than the top-k (so pages drop in and out of it) but shorter than the
    buffer: a page is loaded the first time a request wants it in a layer, never again."""
    hot_pages = 32
    wanted = WantedPages()
    got = await serve_hot(
        CacheMode.DEVICE_HOST,
        workload("chat"),
        hicache_config(None),
        hot_engine(hot_pages),
        watch=wanted.install,
    )
    assert not got.result.errors
    longest = max(p[-1] for p in _decode_positions(got.result).values() if len(p))
    assert TOPK < longest // PAGE + 1 <= hot_pages
    assert got.stats is not None
    distinct = sum(len(pages) for pages in wanted.by_request.values())
    assert got.stats.missed_pages == distinct
    assert distinct < got.stats.wanted_pages  # pages were wanted again and hit
    assert_given_back(got, "roomy buffer")


# ----- 4. admission counts the hot buffer, not the context --------------------------------------
async def test_admission_counts_the_buffer_not_the_context() -> None:
    """A device pool of 64 tokens and prompts of 40 (plus 8 to generate): without HiSparse the
    whole context takes device slots and one request runs at a time; with it only the prefill
    does, and several run at once."""
    shapes = [(40, 8)] * 4
    config = hicache_config(None)
    engine = dataclasses.replace(ENGINE, max_running=4)
    plain = await serve_hot(
        CacheMode.DEVICE_HOST, _at_once(shapes), config, engine, device_tokens=64, logits=True
    )
    hot = await serve_hot(
        CacheMode.DEVICE_HOST,
        _at_once(shapes),
        config,
        hot_engine(TOPK, engine),
        device_tokens=64,
        logits=True,
    )
    assert len(plain.result.outputs) == len(hot.result.outputs) == len(shapes)
    assert_same_run(hot.result, plain.result, "HiSparse against the plain host tier")
    assert max(plain.running) == 1
    assert max(hot.running) > 1
    assert_hisparse_used(hot, "admission")
    assert_given_back(hot, "admission")


async def test_a_context_longer_than_the_device_pool_is_served() -> None:
    """The output never takes device slots: a prompt that fits the pool with an output that
    does not is served, token for token as a no-cache run on a pool big enough."""
    shapes = [(DEVICE_TOKENS - 8, 24), (30, 4)]
    assert sum(shapes[0]) > DEVICE_TOKENS
    want = await serve_hot(
        CacheMode.NONE,
        _at_once(shapes),
        hicache_config(None),
        ENGINE,
        device_tokens=2 * DEVICE_TOKENS,
        logits=True,
    )
    got = await serve_hot(
        CacheMode.DEVICE_HOST, _at_once(shapes), hicache_config(None), hot_engine(TOPK), logits=True
    )
    assert len(want.result.outputs) == len(shapes)
    assert_same_run(got.result, want.result, "longer than the device pool")
    assert_hisparse_used(got, "longer than the device pool")
    assert_given_back(got, "longer than the device pool")


# ----- 5. refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("hot_pages", 0),
        ("hot_pages", -1),
        ("hot_pages", "4"),
        ("hot_pages", 4.0),
        ("hot_pages", True),
        ("index_tokens", -4),
        ("index_tokens", 8.0),
    ],
)
def test_bad_hisparse_config_is_refused(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        HiSparseConfig(**{name: value})  # type: ignore[arg-type]


def test_check_refuses_a_topk_larger_than_the_buffer_and_non_dsa_models() -> None:
    dsa = model_config(DSA)
    HiSparseConfig(hot_pages=TOPK).check(dsa, DEVICE_TOKENS)  # exactly the top-k: accepted
    with pytest.raises(ConfigError, match="--hot-pages"):
        HiSparseConfig(hot_pages=TOPK - 1).check(dsa, DEVICE_TOKENS)
    bigger = dataclasses.replace(dsa, index_topk_pages=TOPK + 3)
    with pytest.raises(ConfigError, match="--index-topk"):
        HiSparseConfig(hot_pages=TOPK + 2).check(bigger, DEVICE_TOKENS)
    for preset in (ModelPreset.DENSE, ModelPreset.MLA):
        with pytest.raises(ConfigError, match="dsa"):
            HiSparseConfig(hot_pages=TOPK).check(model_config(preset), DEVICE_TOKENS)


async def test_open_engine_refuses_before_anything_runs(tmp_path: pathlib.Path) -> None:
    """A buffer smaller than the top-k, a mode without a host tier, a model without sparse
    attention: ConfigError before any pool or L3 store is opened."""
    l3 = tmp_path / "l3"
    config = hicache_config(l3)
    cases = [
        (DSA, CacheMode.DEVICE_HOST_L3, hot_engine(TOPK - 1), "--hot-pages"),
        (DSA, CacheMode.NONE, hot_engine(TOPK), "host tier"),
        (DSA, CacheMode.DEVICE, hot_engine(TOPK), "host tier"),
        (ModelPreset.MLA, CacheMode.DEVICE_HOST_L3, hot_engine(TOPK), "dsa"),
        (ModelPreset.DENSE, CacheMode.DEVICE_HOST, hot_engine(TOPK), "dsa"),
    ]
    for preset, mode, engine, message in cases:
        with pytest.raises(ConfigError, match=message):
            await open_engine(tiny_model(preset), mode, config, DEVICE_TOKENS, engine)
        assert not l3.exists(), (preset, mode)
    # The same configuration with a buffer as big as the top-k opens (and writes nothing yet).
    setup = await open_engine(
        tiny_model(DSA), CacheMode.DEVICE_HOST_L3, config, DEVICE_TOKENS, hot_engine(TOPK)
    )
    try:
        assert setup.engine.sparse is not None
        assert setup.engine.sparse.buffer.hot_pages == TOPK
    finally:
        await setup.close()


async def test_a_request_past_the_indexer_slots_fails_alone() -> None:
    """Indexer slots for 160 tokens: a prompt and output past them fail with a clear error, as
    does a prompt longer than the device pool (128 tokens, for its prefill); the others are
    served, one of them using every indexer slot (and one generating a single token, so
    never decoding from the buffer)."""
    index_tokens = 160
    engine = hot_engine(TOPK, index_tokens=index_tokens)
    shapes = [(20, 4), (100, 61), (30, 3), (DEVICE_TOKENS + 4, 1), (120, 40), (9, 1)]
    assert sum(shapes[1]) == index_tokens + 1 and sum(shapes[4]) == index_tokens
    got = await serve_hot(CacheMode.DEVICE_HOST, _at_once(shapes), hicache_config(None), engine)
    errors = {r.rid: r.error for r in got.result.records if r.error is not None}
    assert set(errors) == {"r1", "r3"}, errors
    for part in ("indexer slots", "100 tokens", "61 to generate", f"({index_tokens} tokens)"):
        assert part in errors["r1"], errors["r1"]
    assert "device pool" in errors["r3"] and f"{DEVICE_TOKENS + 4} tokens" in errors["r3"]
    assert {rid: len(out) for rid, out in got.result.outputs.items()} == {
        "r0": 4, "r2": 3, "r4": 40, "r5": 1
    }  # fmt: skip
    assert_hisparse_used(got, "refused requests")
    assert_given_back(got, "refused requests")


# ----- the command line --------------------------------------------------------------------------
DSA_FLAGS = ["--preset", "dsa", "--index-topk", str(TOPK)]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--preset", "dsa", "--hisparse", "--hot-pages", "2", "--index-topk", "4"], "--hot-pages"),
        (["--preset", "dense", "--hisparse"], "dsa"),
        (["--preset", "mla", "--hisparse", "--hot-pages", "8"], "--hisparse"),
    ],
    ids=["topk-over-buffer", "dense", "mla"],
)
def test_cli_refuses_hisparse_it_cannot_serve(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, flags: list[str], named: str
) -> None:
    l3 = tmp_path / "l3"
    code, out, err = run(capsys, *TINY, *CHAT, *flags, "--cache-dir", str(l3), "--json")
    assert code == 2, err
    assert named in one_line_error(err)
    assert out == "" and not l3.exists()  # refused before anything ran


def test_cli_compare_with_hisparse_is_identical(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compare``: none and device without HiSparse, the host tiers with it; the same
    tokens everywhere, and the host tiers really decoded from the buffer."""
    setups = keep_setups(monkeypatch)
    flags = [*DSA_FLAGS, "--hisparse", "--hot-pages", str(TOPK), "--compare"]
    code, out, err = run(capsys, *TINY, *CHAT, *flags, "--cache-dir", str(tmp_path), "--json")
    assert code == 0, err
    result = json.loads(out)
    rows = result["configs"]
    assert [r["name"] for r in rows] == ["none", "device", "device+host", "device+host+l3"]
    assert all(r["requests"] == 6 and r["failed"] == 0 for r in rows)
    assert result["outputs_identical"] is True
    assert [s.engine.sparse is not None for s in setups] == [False, False, True, True]
    for setup in setups[2:]:
        sparse = setup.engine.sparse
        assert sparse is not None and sparse.buffer.hot_pages == TOPK
        assert sparse.buffer.stats.decode_rows > 0 and sparse.buffer.stats.missed_pages > 0


async def test_a_prompt_host_memory_cannot_hold_fails_alone() -> None:
    """HiSparse keeps the whole context on host: a prompt of more pages than the host tier has
    fails once computed, with a clear error and nothing held; shorter ones are served."""
    host_pages = 8
    shapes = [(12, 3), ((host_pages + 2) * PAGE, 4), (8, 4)]
    got = await serve_hot(
        CacheMode.DEVICE_HOST,
        _at_once(shapes),
        hicache_config(None, host_pages=host_pages),
        hot_engine(TOPK),
    )
    errors = {r.rid: r.error for r in got.result.records if r.error is not None}
    assert set(errors) == {"r1"}, errors
    assert "host memory" in errors["r1"], errors
    assert {rid: len(out) for rid, out in got.result.outputs.items()} == {"r0": 3, "r2": 4}
    assert_hisparse_used(got, "host full")
    assert_given_back(got, "host full")
