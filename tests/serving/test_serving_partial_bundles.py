"""A page whose bundle is incomplete in L3 is a miss: a hybrid model's pages without their
recurrent state, or a DSA model's without their indexer keys, are never used.

One engine writes the prompts' pages to a file L3; the objects of one pool are then deleted for
some prompts only (their keys built the way the engine builds them), and a fresh engine serves
the same prompts again. The untouched prompts hit in L3, the damaged ones are recomputed, and
every output is what the model says with no cache at all.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from serving_kit import (
    PAGE,
    VOCAB,
    RunResult,
    assert_same_run,
    hicache_config,
    model_config,
    serve,
    trace,
)

from hicache.backends.registry import open_backend
from hicache.keys import PageKeyScheme, RadixKey, storage_key
from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode

PROMPTS = 4
PROMPT_TOKENS = 45  # 44 reusable tokens: 11 whole pages
DAMAGED = (1, 3)  # prompts whose pages lose one pool's objects


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [
        torch.randint(0, VOCAB, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(PROMPTS)
    ]


def _page_keys(run: RunResult, pool: str, prompt: list[int]) -> list[str]:
    """The L3 keys of ``pool``'s objects for the whole token pages of a prompt's reusable part:
    the token pages' chained hashes under the pool's format (a snapshot pool's format has pages
    of one snapshot, but its objects are named by the token page they end)."""
    reusable = RadixKey(prompt[:-1]).page_aligned(PAGE)
    tokens = PageKeyScheme(run.formats[next(iter(run.formats))])  # the anchor: token pages
    namespace = tokens.namespace(None)
    return [storage_key(namespace, run.formats[pool], h) for h in tokens.page_hashes(reusable)]


async def _delete_pool_objects(url: str, keys: list[str], every_page: bool) -> None:
    """Delete ``keys``' objects; all of them must exist for a pool stored on every page, at
    least one for a snapshot pool (stored at some page ends only)."""
    backend = await open_backend(url)
    try:
        found = await backend.exists(keys)
        assert all(found) if every_page else any(found), "the keys must name what was written"
        keys = [k for k, there in zip(keys, found, strict=True) if there]
        assert all(await backend.delete(keys))
        assert not any(await backend.exists(keys))
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("preset", "pool"),
    [
        pytest.param(ModelPreset.HYBRID, "conv", id="hybrid-without-state"),
        pytest.param(ModelPreset.DSA, "indexer", id="dsa-without-indexer"),
    ],
)
async def test_incomplete_bundles_are_not_used(
    preset: ModelPreset, pool: str, tmp_path: pathlib.Path
) -> None:
    prompts = _prompts()
    config = hicache_config(tmp_path / "l3")
    want = await serve(preset, CacheMode.NONE, trace(prompts), logits=True)
    first = await serve(preset, CacheMode.DEVICE_HOST_L3, trace(prompts), config)
    assert_same_run(first, want, "writing run")
    assert first.metrics["pages_written_l3"] >= PROMPTS * (PROMPT_TOKENS // PAGE)
    assert set(first.formats) == set(model_config(preset).pools().names)

    damaged = [k for i in DAMAGED for k in _page_keys(first, pool, prompts[i])]
    await _delete_pool_objects(str(config.storage.url), damaged, pool != "conv")
    # The other pools' objects of the damaged pages are still there: the bundle is partial.
    other = next(name for name in first.formats if name != pool)
    kept = [k for i in DAMAGED for k in _page_keys(first, other, prompts[i])]
    backend = await open_backend(str(config.storage.url))
    try:
        assert all(await backend.exists(kept))
    finally:
        await backend.close()

    again = await serve(preset, CacheMode.DEVICE_HOST_L3, trace(prompts), config, logits=True)
    assert_same_run(again, want, "run over the damaged L3")
    by_rid = {r.rid: r for r in again.records}
    reusable = (PROMPT_TOKENS - 1) // PAGE * PAGE
    for i in range(PROMPTS):
        record = by_rid[f"t{i}"]
        if i in DAMAGED:
            assert record.hit_l3 == 0 and record.computed_tokens == PROMPT_TOKENS, record
        else:  # the intact prompts show that L3 was read at all
            assert record.hit_l3 == reusable, record
    assert again.metrics["corrupt_pages"] == 0
