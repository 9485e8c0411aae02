"""Each pool its own lifecycle on the device: the SWA window pool keeps windows only, the
recurrent state is snapshotted every ``state_interval`` tokens and at request ends, and neither
changes what the model says.

Runs serve with no cache and with the device tree (a ShadowRadixCache) and compare tokens and
logits; a probe checks after every chunk is given its slots that the requests hold no more of
the SWA pool than admission reserved, and after the run that every slot is back or in the tree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest
import torch
from serving_kit import (
    CHAT,
    PAGE,
    VOCAB,
    Recording,
    RunResult,
    _capture_logits,
    assert_same_run,
    model_config,
    trace,
)

from hicache.errors import ConfigError
from hicache.keys import RadixKey
from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.tiny import TinyTransformer
from hicache.models.types import ChunkInput
from hicache.pools.device import DevicePool, device_pools
from hicache.serving.engine import CacheMode, Engine, EngineConfig, RequestSource
from hicache.serving.engine_events import ChunkPlanned
from hicache.serving.pool_slots import swa_reserve
from hicache.serving.setup import ServingSetup, device_slots, open_engine
from hicache.tiering.common.config import HiCacheConfig
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.synthetic import MultiTurnChat, SharedPrefixConfig, shared_prefix_trace

DEVICE_TOKENS = 256


def tiny(preset: ModelPreset, **changes: int) -> TinyTransformer:
    return TinyTransformer(dataclasses.replace(model_config(preset), **changes))


def model_with_pools(
    preset: ModelPreset, tokens: dict[str, int], **changes: int
) -> tuple[TinyTransformer, dict[str, DevicePool]]:
    """A tiny model and device pools of ``tokens`` slots each on the CPU, for forward calls
    with no engine around them."""
    model = tiny(preset, **changes)
    return model, device_pools(model.config.pools(), tokens, "cpu")


def longdoc(requests: int = 12, docs: int = 3, doc_tokens: int = 60) -> RequestSource:
    """Documents asked several questions (``hicache serve --workload longdoc``, small)."""
    config = SharedPrefixConfig(
        requests=requests, prefixes=docs, prefix_tokens=doc_tokens, question_tokens=10,
        output_tokens=3, vocab=VOCAB, seed=5,
    )  # fmt: skip
    return TraceReplay(shared_prefix_trace(config))


class Probe:
    """Checks the extra pools' accounting each time a chunk got its slots."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.peak_swa = 0  # most SWA slots held by running requests and their locks at once
        self.steps = 0
        engine.observe(lambda planned: self.check(planned.request, planned.chunk), ChunkPlanned)

    def check(self, request: Any, chunk: ChunkInput) -> None:
        self.steps += 1
        slots = self.engine.pool_slots
        state = request.pool_state
        for name, window in slots.windows.items():
            row = chunk.pool_slots[name]
            lo = max(0, chunk.start - window + 1)
            assert bool((row[lo:] >= 0).all()), "the chunk's window is held"
            own = int(state.owned[name].sum())
            ps = self.engine.model.config.page_size
            longest = max(1, min(self.engine.config.chunk_tokens, len(request.prompt)))
            assert own <= window + (math.ceil(longest / ps) + 1) * ps
            assert own <= state.reserved[name]
        # Together: what the requests own plus what their locks pin is within the reservations.
        for name in slots.windows:
            pool = self.engine.pools[name]
            tree = self.engine.tree
            held_by_tree = tree.ledger.size(name) if tree is not None else 0
            requests_own = pool.used_size - held_by_tree
            pinned = tree.ledger.protected(name) if tree is not None else 0
            assert requests_own + pinned <= slots.reserved[name] <= pool.size
            self.peak_swa = max(self.peak_swa, requests_own + pinned)


async def run(
    model: TinyTransformer,
    mode: CacheMode,
    source: RequestSource,
    chunk_tokens: int = 8,
    device_tokens: int = DEVICE_TOKENS,
    max_running: int = 2,
) -> tuple[RunResult, ServingSetup, Probe]:
    """Serve ``source``; the setup is returned open, for the caller to look at its pools."""
    engine_config = EngineConfig(max_running=max_running, chunk_tokens=chunk_tokens, stall_s=20.0)
    setup = await open_engine(model, mode, HiCacheConfig(), device_tokens, engine_config)
    recording = Recording(source)
    logits: dict[tuple[str, int], torch.Tensor] = {}
    _capture_logits(setup, logits)
    probe = Probe(setup.engine)
    records = await asyncio.wait_for(setup.engine.run(recording), 60.0)
    result = RunResult(recording.outputs, records, {}, recording.prompts, logits)
    return result, setup, probe


def check_slots_back(setup: ServingSetup) -> None:
    """Every slot of every pool is free, but for what the tree holds; none after a reset."""
    engine, tree = setup.engine, setup.engine.tree
    for name, pool in engine.pools.items():
        if not pool.owns_slots:
            continue
        held = tree.ledger.size(name) if tree is not None else 0
        assert pool.available_size == pool.size - held, name
    assert engine.req_to_token.available_size == engine.config.max_running  # every row back
    if tree is not None:
        assert all(tree.ledger.protected(name) == 0 for name in engine.pools)  # no lock left
        tree.reset()
        for name, pool in engine.pools.items():
            assert pool.available_size == pool.size, name


# ----- outputs -------------------------------------------------------------------------------
CASES = [
    (ModelPreset.DENSE, {}),
    (ModelPreset.MLA, {}),
    (ModelPreset.DSA, {}),
    (ModelPreset.SWA, {"window": 4, "window_interval": 8}),
    (ModelPreset.SWA, {"window": 8, "window_interval": 16}),
    (ModelPreset.SWA, {"window": 24, "window_interval": 32}),
    (ModelPreset.HYBRID, {"state_interval": 4}),
    (ModelPreset.HYBRID, {"state_interval": 8}),
    (ModelPreset.HYBRID, {"state_interval": 32}),
]


@pytest.mark.parametrize(
    ("preset", "changes"),
    CASES,
    ids=[p.value + "".join(f"-{k}{v}" for k, v in c.items()) for p, c in CASES],
)
@pytest.mark.parametrize("workload", ["chat", "longdoc"])
async def test_device_cache_gives_the_outputs_of_no_cache(
    preset: ModelPreset, changes: dict[str, int], workload: str
) -> None:
    """Chunks of 8 tokens (prompts of 44-88 tokens are prefilled in several), against no cache;
    every slot is back afterwards."""
    model = tiny(preset, **changes)
    sources = {"chat": lambda: MultiTurnChat(CHAT), "longdoc": longdoc}
    want, none_setup, _ = await run(model, CacheMode.NONE, sources[workload]())
    check_slots_back(none_setup)
    got, setup, probe = await run(model, CacheMode.DEVICE, sources[workload]())
    assert_same_run(got, want, f"device, {workload}")
    assert got.hits("device") > 0 and got.computed < want.computed
    assert probe.steps > len(got.records)  # chunked prefill: more chunks than requests
    check_slots_back(setup)


async def test_outputs_do_not_depend_on_the_chunk_size() -> None:
    prompts = [list(range(i, i + 45)) for i in range(0, 200, 50)]
    for preset, changes in ((ModelPreset.SWA, {"window": 8}), (ModelPreset.HYBRID, {})):
        model = tiny(preset, **changes)
        want, _, _ = await run(model, CacheMode.NONE, trace(prompts), chunk_tokens=512)
        for chunk in (4, 12):
            got, _, _ = await run(model, CacheMode.DEVICE, trace(prompts), chunk_tokens=chunk)
            assert_same_run(got, want, f"{preset.value}, chunks of {chunk}")


# ----- SWA -------------------------------------------------------------------------------------
async def test_swa_pool_holds_windows_only() -> None:
    """On a long-document workload the tree keeps far fewer SWA slots than anchor slots, and
    only on nodes within a window of a committed end; running requests never exceed their
    reservation."""
    window, ps, chunk, device = 8, PAGE, 64, 1024
    model = tiny(ModelPreset.SWA, window=window, window_interval=64)
    source = longdoc(requests=16, docs=2, doc_tokens=240)
    got, setup, probe = await run(model, CacheMode.DEVICE, source, chunk, device)
    assert not got.errors and got.hits("device") > 0
    tree = setup.engine.tree
    swa, anchor = tree.ledger.size("swa"), tree.ledger.size("kv")
    # Windows every 64 tokens, at prompt ends and at request ends: on this tiny workload a
    # request adds ~13 tokens of its own (question and answer) and up to 12 of window.
    assert anchor > 0 and 2 * swa <= anchor, (swa, anchor)
    for node in tree.all_nodes():
        data = tree.ledger.data(node, "swa")
        assert data is None or node.length <= window  # a commit gives the tree windows only
    reserve = swa_reserve(window, chunk, ps, tree=True)
    assert 0 < probe.peak_swa <= 2 * reserve
    assert setup.engine.pools["swa"].size <= device
    check_slots_back(setup)


def test_swa_layers_read_only_their_window_and_refuse_a_hole() -> None:
    model, pools = model_with_pools(ModelPreset.SWA, {"kv": 64, "swa": 64}, window=8)
    tokens = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
    kv, swa = pools["kv"].alloc(32), pools["swa"].alloc(32)
    assert kv is not None and swa is not None
    model.forward(ChunkInput(tokens[:24], 0, kv[:24], {"swa": swa[:24]}), pools)
    window_only = swa[:30].clone()
    window_only[:17] = -1  # the query at 24 sees 17..24
    got = model.forward(ChunkInput(tokens[24:], 24, kv[:30], {"swa": window_only}), pools)
    want = model.forward(ChunkInput(tokens[24:], 24, kv[:30], {"swa": swa[:30]}), pools)
    assert torch.equal(got, want)
    window_only[17] = -1
    with pytest.raises(RuntimeError, match="position 17"):
        model.forward(ChunkInput(tokens[24:], 24, kv[:30], {"swa": window_only}), pools)
    with pytest.raises(ValueError, match="swa"):
        model.forward(ChunkInput(tokens[24:], 24, kv[:30]), pools)


# ----- hybrid ----------------------------------------------------------------------------------
async def test_hybrid_snapshots_every_interval_and_at_ends() -> None:
    interval = 16
    model = tiny(ModelPreset.HYBRID, state_interval=interval)
    got, setup, _ = await run(model, CacheMode.DEVICE, longdoc(16, 2, 120), chunk_tokens=32)
    assert not got.errors and got.hits("device") > 0
    tree = setup.engine.tree
    snapshots, anchor = tree.ledger.size("conv"), tree.ledger.size("kv")
    # Where a request snapshots: every interval, the end of its reusable prompt, its final end,
    # and where its prompt leaves another's (a shared document's end).
    ends = set()
    for rid, prompt in got.prompts.items():
        ends.add((len(prompt) - 1) // PAGE * PAGE)
        ends.add((len(prompt) + len(got.outputs[rid]) - 1) // PAGE * PAGE)
        for other in got.prompts.values():
            shared = next((i for i, (a, b) in enumerate(zip(prompt, other)) if a != b), 0)
            ends.add(shared // PAGE * PAGE)
    at_ends, multiples = 0, 0  # multiples: interval multiples along the tree's spans
    for node in tree.all_nodes():
        depth = sum(n.length for n in node.path_to_root())
        multiples += depth // interval - (depth - node.length) // interval
        if tree.ledger.data(node, "conv") is not None:
            assert depth % interval == 0 or depth in ends, depth
            at_ends += depth % interval != 0
    assert multiples <= anchor // interval + len(tree.all_nodes())
    assert 0 < snapshots <= multiples + at_ends, (snapshots, multiples, at_ends)
    assert at_ends <= 3 * len(got.records)
    assert snapshots < anchor // PAGE // 2  # the old scheme kept a state per token
    # A hit ends at a snapshot: every matched prefix ends at a node holding one.
    for rid, prompt in got.prompts.items():
        match = tree.match_prefix(RadixKey(prompt[:-1]), count_hits=False)
        if match.prefix_len:
            assert tree.ledger.data(match.last_device_node, "conv") is not None, rid
    check_slots_back(setup)


def test_resuming_from_a_snapshot_is_computing_through() -> None:
    model, pools = model_with_pools(ModelPreset.HYBRID, {"kv": 64, "conv": 8}, state_interval=8)
    tokens = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(4))
    kv = pools["kv"].alloc(44)
    assert kv is not None
    snaps = {8: 1, 24: 2, 40: 3}
    through = model.forward(ChunkInput(tokens, 0, kv[:41], state_slot=0, snapshots=snaps), pools)
    final = {name: pools[name].read([0]) for name in ("conv", "ssm")}
    for at, slot in snaps.items():
        for name in ("conv", "ssm"):  # the snapshot into another working slot
            pools[name].write([5], pools[name].read([slot]))
        resumed = model.forward(ChunkInput(tokens[at:], at, kv[:41], state_slot=5), pools)
        assert torch.equal(resumed, through), at
        for name in ("conv", "ssm"):
            assert torch.equal(pools[name].read([5]), final[name])
    # In chunks, with the state left in the working slot between them: the same again.
    for lo in range(0, 41, 7):
        hi = min(lo + 7, 41)
        chunked = model.forward(ChunkInput(tokens[lo:hi], lo, kv[:hi], state_slot=6), pools)
    assert torch.equal(chunked, through)
    with pytest.raises(ValueError, match="state slot"):
        model.forward(ChunkInput(tokens[:4], 0, kv[:4]), pools)


# ----- presets ----------------------------------------------------------------------------------
def test_presets_give_each_pool_its_own_slots() -> None:
    swa = ModelConfig(preset=ModelPreset.SWA, window=32, page_size=16).pools()
    assert swa.names == ("kv", "swa") and swa.pool("swa").shares_slots_with is None
    assert swa.pool("swa").hit_rule.pages == 2
    hybrid = ModelConfig(preset=ModelPreset.HYBRID, conv_kernel=3, state_inner=24).pools()
    assert hybrid.names == ("kv", "conv", "ssm")
    conv, ssm = hybrid.pool("conv"), hybrid.pool("ssm")
    assert conv.layout.item_shape == (2, 24) and conv.layout.page_size == 1
    assert ssm.layout.item_shape == (24, 16) and ssm.shares_slots_with == "conv"
    with pytest.raises(ConfigError, match=r"--window \(model window\)"):
        ModelConfig(preset=ModelPreset.SWA, window=20, page_size=16)
    with pytest.raises(ConfigError, match="--state-interval"):
        ModelConfig(preset=ModelPreset.HYBRID, state_interval=24, page_size=16)
    with pytest.raises(ConfigError, match="conv_kernel"):
        ModelConfig(preset=ModelPreset.HYBRID, conv_kernel=1)
    ModelConfig(preset=ModelPreset.DENSE, window=20, page_size=16)  # unused there: not checked


def test_device_slots_fit_a_request_and_stay_near_the_anchor() -> None:
    engine = EngineConfig(max_running=4, chunk_tokens=512)
    swa = ModelConfig(preset=ModelPreset.SWA, window=64, page_size=16)
    slots = device_slots(swa, 4608, engine)
    assert slots["kv"] == 4608 and swa_reserve(64, 512, 16, True) <= slots["swa"] <= 4608
    hybrid = ModelConfig(preset=ModelPreset.HYBRID, state_interval=128, page_size=16)
    assert device_slots(hybrid, 4608, engine)["conv"] == 4 + 36 + 16
