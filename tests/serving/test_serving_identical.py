"""Caching never changes what the model says: every preset, every cache mode, every policy.

Greedy outputs (and the logits they were sampled from) of a run with no cache are the reference;
runs that reuse device, host and L3 pages must match them token for token, and must really have
reused pages from the tiers they claim (hit counts), or the comparison would prove nothing.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from serving_helpers import (
    ALL_PRESETS,
    CHAT,
    PAGE,
    VOCAB,
    assert_same_run,
    baseline,
    hicache_config,
    model_config,
    relative_error,
    revisit_prompts,
    serve,
    tiny_model,
    workload,
)

from hicache.pools.device import DevicePool, device_pools
from hicache.pools.host import host_pools
from hicache.pools.pool_spec import ModelPools
from hicache.serving.engine import CacheMode
from hicache.serving.model import ChunkInput
from hicache.serving.presets import ModelPreset
from hicache.tiering.policies import PrefetchStopPolicy, WritePolicy

PRESET_IDS = [p.value for p in ALL_PRESETS]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ALL_PRESETS, ids=PRESET_IDS)
async def test_chat_outputs_identical_across_cache_modes(
    preset: ModelPreset, tmp_path: pathlib.Path
) -> None:
    want = await baseline(preset)
    requests = CHAT.clients * CHAT.rounds
    assert len(want.outputs) == requests and want.hits("device") == 0
    assert all(len(out) == CHAT.output_tokens for out in want.outputs.values())

    device = await serve(preset, CacheMode.DEVICE, workload("chat"), logits=True)
    assert_same_run(device, want, "device")
    assert device.hits("device") > 0 and device.hits("host") == device.hits("l3") == 0
    assert device.computed < want.computed

    host = await serve(
        preset, CacheMode.DEVICE_HOST, workload("chat"), hicache_config(None), logits=True
    )
    assert_same_run(host, want, "device+host")
    assert host.hits("device") > 0 and host.hits("host") > 0 and host.hits("l3") == 0
    assert host.metrics["bytes_host_to_device"] > 0

    config = hicache_config(tmp_path / "l3")
    l3 = await serve(preset, CacheMode.DEVICE_HOST_L3, workload("chat"), config, logits=True)
    assert_same_run(l3, want, "device+host+l3")
    assert l3.hits("device") > 0 and l3.hits("host") > 0
    assert l3.metrics["pages_written_l3"] > 0 and l3.metrics["corrupt_pages"] == 0

    # A restart over the same L3: the new engine's device and host start empty.
    again = await serve(preset, CacheMode.DEVICE_HOST_L3, workload("chat"), config, logits=True)
    assert_same_run(again, want, "device+host+l3 after a restart")
    assert again.hits("l3") > 0
    assert again.metrics["bytes_l3_to_host"] > 0
    assert again.computed < want.computed


@pytest.mark.parametrize("preset", ALL_PRESETS, ids=PRESET_IDS)
async def test_revisited_prompts_come_from_l3_and_match(
    preset: ModelPreset, tmp_path: pathlib.Path
) -> None:
    """One request at a time: distinct documents push the first ones out of the device and
    host tiers, so asking about them again hits in L3 (in the same run, no restart)."""
    want = await baseline(preset, "revisit")
    config = hicache_config(tmp_path / "l3")
    got = await serve(preset, CacheMode.DEVICE_HOST_L3, workload("revisit"), config, logits=True)
    assert_same_run(got, want, "device+host+l3")
    prompts = revisit_prompts()
    revisits = [r for r in got.records if int(r.rid[1:]) >= len(prompts) - 3]
    doc_tokens = len(prompts[0])  # the documents' whole pages: 44 tokens, 11 pages
    assert doc_tokens % PAGE == 0
    for record in revisits:
        assert record.hit_device + record.hit_host + record.hit_l3 == doc_tokens, record
    assert revisits[0].hit_l3 == doc_tokens, "the first document cannot still be on host"
    assert got.computed == want.computed - sum(r.hit_l3 + r.hit_host for r in revisits)


def _policy_cases() -> list[tuple[ModelPreset, WritePolicy, PrefetchStopPolicy]]:
    """Every write and stop policy on every preset, and their full cross product on dense
    (the whole product on every preset would double this file's run time)."""
    cases = []
    for preset in ALL_PRESETS:
        for write in WritePolicy:
            for stop in PrefetchStopPolicy:
                crossed = write is not WritePolicy.WRITE_THROUGH and (
                    stop is not PrefetchStopPolicy.TIMEOUT
                )
                if preset is ModelPreset.DENSE or not crossed:
                    cases.append((preset, write, stop))
    return cases


POLICY_CASES = _policy_cases()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "write", "stop"),
    POLICY_CASES,
    ids=[f"{p.value}-{w.value}-{s.value}" for p, w, s in POLICY_CASES],
)
async def test_policies_keep_outputs_identical(
    preset: ModelPreset,
    write: WritePolicy,
    stop: PrefetchStopPolicy,
    tmp_path: pathlib.Path,
) -> None:
    want = await baseline(preset)
    config = hicache_config(tmp_path / "l3", write, stop)
    first = await serve(preset, CacheMode.DEVICE_HOST_L3, workload("chat"), config)
    assert_same_run(first, want, "first run")
    assert first.hits("device") > 0 and first.metrics["pages_written_l3"] > 0
    restart = await serve(preset, CacheMode.DEVICE_HOST_L3, workload("chat"), config)
    assert_same_run(restart, want, "after a restart")
    if stop is not PrefetchStopPolicy.BEST_EFFORT:  # best effort may run before any read lands
        # Tokens the tree took from L3; which request the records credit them to depends on
        # who is admitted first (another may find them on host), so count them at the tree.
        assert restart.metrics["l3_hit_tokens"] > 0


# ----- the model alone: a prefix from the cache gives the logits of a full recompute ----------


def _copy_through_host(
    spec: ModelPools,
    src: dict[str, DevicePool],
    slots: torch.Tensor,
    dst: dict[str, DevicePool],
    into: torch.Tensor,
) -> None:
    """Move whole pages of the pools in ``dst`` device -> host -> device, as the tiers do."""
    anchor = spec.names[0]
    host = host_pools(spec, {anchor: len(slots) // PAGE})
    pages = host[anchor].alloc(len(slots) // PAGE)
    assert pages is not None
    for name in dst:
        host[name].backup(src[name], slots, pages).synchronize()
        host[name].load(pages, dst[name], into).synchronize()


def _prefill(
    preset: ModelPreset, tokens: torch.Tensor, split: int, drop: str | None = None
) -> torch.Tensor:
    """Logits of ``tokens`` computed as ``tokens[:split]`` in one engine, its pages moved
    through host memory into another engine's pools at other slots, then the rest there.
    ``drop``: a pool whose pages are not moved (a bundle missing part of its state)."""
    model = tiny_model(preset)
    spec = model.config.pools()
    first = device_pools(spec, {spec.names[0]: 64}, "cpu")
    slots = first[spec.names[0]].alloc(split)
    assert slots is not None
    model.forward(ChunkInput(tokens[:split], 0, slots), first)
    second = device_pools(spec, {spec.names[0]: 128}, "cpu")
    taken = second[spec.names[0]].alloc(128)
    assert taken is not None
    at = taken.flip(0).reshape(-1, PAGE).flip(1).reshape(-1)[: len(tokens) + PAGE]
    at = at[PAGE:]  # other slots than the first engine used, pages in another order
    moved = {name: pool for name, pool in second.items() if name != drop}
    _copy_through_host(spec, first, slots, moved, at[:split])
    return model.forward(ChunkInput(tokens[split:], split, at[: len(tokens)]), second)


@pytest.mark.parametrize("preset", ALL_PRESETS, ids=PRESET_IDS)
def test_cached_prefix_logits_match_full_recompute(preset: ModelPreset) -> None:
    model = tiny_model(preset)
    tokens = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(3))
    spec = model.config.pools()
    pools = device_pools(spec, {spec.names[0]: 64}, "cpu")
    slots = pools[spec.names[0]].alloc(44)  # whole pages
    assert slots is not None
    full = model.forward(ChunkInput(tokens, 0, slots[: len(tokens)]), pools)
    assert full.dtype == torch.float32 and full.shape == (VOCAB,)
    for split in (PAGE, 3 * PAGE, 10 * PAGE):
        got = _prefill(preset, tokens, split)
        assert relative_error(got, full) <= 1e-4, f"prefix of {split} tokens"
    # Computed in several chunks in one engine: the same again.
    pools = device_pools(spec, {spec.names[0]: 64}, "cpu")
    slots = pools[spec.names[0]].alloc(44)  # whole pages
    assert slots is not None
    for lo in range(0, len(tokens), 12):
        hi = min(lo + 12, len(tokens))
        logits = model.forward(ChunkInput(tokens[lo:hi], lo, slots[:hi]), pools)
    assert relative_error(logits, full) <= 1e-4


@pytest.mark.parametrize(
    "preset",
    [p for p in ALL_PRESETS if len(model_config(p).pools().names) > 1],
    ids=lambda p: p.value,
)
def test_prefix_without_a_sidecar_pool_changes_logits(preset: ModelPreset) -> None:
    """The check above can fail: leave the DSA indexer, SWA or recurrent state pages behind
    and the logits move far past the tolerance."""
    tokens = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(3))
    names = model_config(preset).pools().names
    whole = _prefill(preset, tokens, 10 * PAGE)
    partial = _prefill(preset, tokens, 10 * PAGE, drop=names[-1])
    assert relative_error(partial, whole) > 1e-3
