"""A finished request's generated pages are in the tree, with HiSparse and without.

A first turn generates past several page boundaries; a follow-up whose prompt is the first
turn's prompt, its output and a new question then finds every whole page of that conversation
cached (device, or host with HiSparse, whose output never took device slots), computes only
the rest, and generates exactly what it generates on a cold cache.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from follow_up_kit import FollowUp
from model_kit import PAGE, VOCAB, tiny_model

from hicache.keys import RadixKey
from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.request import RequestRecord, ServeRequest
from hicache.serving.setup import open_engine
from hicache.sparse.hot_buffer import HiSparseConfig
from hicache.tiering.common.config import HiCacheConfig, StorageConfig, TierConfig

DSA = ModelPreset.DSA
FIRST_OUTPUT = 14  # past three page boundaries of PAGE = 4
PROMPT = 21  # a partial last page: the first output page also holds prompt tokens
ENGINE = EngineConfig(max_running=2, stall_s=20.0, skip_slow_prefetch=False)


class Cold:
    """One request alone, on whatever cache the engine has (empty)."""

    def __init__(self, prompt: list[int], output: int) -> None:
        self._pending = [ServeRequest("cold", list(prompt), output)]
        self.done: dict[str, ServeRequest] = {}

    def due(self, now: float) -> list[ServeRequest]:
        due, self._pending = self._pending, []
        return due

    def finished(self, request: ServeRequest, now: float) -> None:
        self.done[request.rid] = request

    def next_arrival(self) -> float | None:
        return 0.0 if self._pending else None


def _engine(hisparse: bool) -> EngineConfig:
    hot = HiSparseConfig(hot_pages=4) if hisparse else None
    return dataclasses.replace(ENGINE, hisparse=hot)


async def _serve(source: FollowUp | Cold, mode: CacheMode, hisparse: bool) -> list[RequestRecord]:
    config = HiCacheConfig(tiers=TierConfig(host_pages=64))
    setup = await open_engine(tiny_model(DSA), mode, config, 128, _engine(hisparse))
    try:
        return await setup.engine.run(source)
    finally:
        await setup.close()


@pytest.mark.parametrize(
    ("mode", "hisparse"),
    [(CacheMode.DEVICE, False), (CacheMode.DEVICE_HOST, False), (CacheMode.DEVICE_HOST, True)],
    ids=["device", "device+host", "device+host-hisparse"],
)
async def test_a_follow_up_hits_the_pages_the_first_turn_generated(
    mode: CacheMode, hisparse: bool
) -> None:
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist()
    question = torch.randint(0, VOCAB, (7,), generator=gen).tolist()
    source = FollowUp(prompt, question, FIRST_OUTPUT)
    records = {r.rid: r for r in await _serve(source, mode, hisparse)}
    first, second = source.done["turn1"], source.done["turn2"]
    assert len(first.generated) == FIRST_OUTPUT and len(second.generated) == 6

    # The first turn computed its prompt and every output token but the last.
    computed = PROMPT + FIRST_OUTPUT - 1
    whole = computed // PAGE * PAGE
    assert whole > -(-PROMPT // PAGE) * PAGE  # whole pages of output alone
    follow = records["turn2"]
    hit = follow.hit_device + follow.hit_host + follow.hit_l3
    assert hit == whole, follow
    assert follow.computed_tokens == len(second.prompt) - whole
    if hisparse:  # the output lived on host only
        assert follow.hit_host >= whole - PROMPT // PAGE * PAGE > 0, follow

    cold = Cold(second.prompt, 6)
    cold_records = await _serve(cold, CacheMode.NONE, False)
    assert cold_records[0].computed_tokens == len(second.prompt)
    assert cold.done["cold"].generated == second.generated


async def test_the_generated_pages_are_written_to_l3(tmp_path: pathlib.Path) -> None:
    """With HiSparse over L3: the nodes a finished request hangs under the tree are written to
    L3 as backups are (the request's own pages, nothing else reads them), so its output
    outlives host memory; the tree's host pages are exactly its nodes' afterwards."""
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist()
    config = HiCacheConfig(
        tiers=TierConfig(host_pages=64), storage=StorageConfig(url=f"file://{tmp_path}/l3")
    )
    first = Cold(prompt, FIRST_OUTPUT)
    setup = await open_engine(tiny_model(DSA), CacheMode.DEVICE_HOST_L3, config, 128, _engine(True))
    try:
        await setup.engine.run(first)
        tree = setup.cache
        assert tree is not None
        await tree.quiesce()
        tokens = prompt + first.done["cold"].generated
        whole = (PROMPT + FIRST_OUTPUT - 1) // PAGE * PAGE
        match = tree.match_prefix(RadixKey(tokens[:whole]), count_hits=False)
        assert match.prefix_len + match.host_hit_length == whole
        path = match.last_host_node.path_to_root()
        output_nodes = [n for n in path if n.value is None and n.parent is not None]
        assert sum(n.length for n in output_nodes) == whole - PROMPT // PAGE * PAGE
        assert all(n.in_storage for n in output_nodes)
        # the prompt's pages too: they were protected on host while the request decoded from
        # them, which must not pass for a write to L3 in flight
        prompt_nodes = [n for n in path if n.value is not None and n.parent is not None]
        assert prompt_nodes and all(n.in_storage for n in prompt_nodes), prompt_nodes
        written = tree.metrics.as_dict()["pages_written_l3"]
        assert written >= (whole - PROMPT // PAGE * PAGE) // PAGE
    finally:
        await setup.close()


async def test_identical_requests_cache_their_output_once() -> None:
    """Two identical requests decode side by side from the buffer and generate the same
    tokens: the one finishing second finds its output pages in the tree and frees its own;
    afterwards the host pool holds exactly the tree's pages, none protected."""
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist()
    twins = [ServeRequest(f"twin{i}", list(prompt), FIRST_OUTPUT) for i in range(2)]
    source = Cold(prompt, FIRST_OUTPUT)
    source._pending = twins
    config = HiCacheConfig(tiers=TierConfig(host_pages=64))
    setup = await open_engine(tiny_model(DSA), CacheMode.DEVICE_HOST, config, 128, _engine(True))
    try:
        await setup.engine.run(source)
    finally:
        await setup.close()
    assert source.done["twin0"].generated == source.done["twin1"].generated
    tree = setup.cache
    assert tree is not None
    held = sum(len(n.host_value) for n in tree.all_nodes() if n.host_value is not None)
    assert tree.host.used_pages == held and tree.host.protected_pages == 0
    tokens = prompt + source.done["twin0"].generated
    whole = (PROMPT + FIRST_OUTPUT - 1) // PAGE * PAGE
    match = tree.match_prefix(RadixKey(tokens[:whole]), count_hits=False)
    assert match.prefix_len + match.host_hit_length == whole
