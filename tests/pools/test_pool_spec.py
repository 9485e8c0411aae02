"""Pool specs, hit rules (hand-made cases and brute force), model pools and every preset."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from hicache.codec import PageMeta
from hicache.dtypes import DType
from hicache.errors import InvalidArgumentError, LayoutError
from hicache.layouts import Layout, LayoutSpec, page_shape
from hicache.pools import (
    ALL_PAGES,
    STATE_AT_END,
    Granularity,
    HitRule,
    HitRuleKind,
    ModelPools,
    ModelShape,
    PoolPreset,
    PoolSpec,
    common_usable_prefix,
    preset,
    usable_ends,
    usable_prefix,
    validate_pool_name,
)

T, F = True, False
KV = LayoutSpec.mha(2, 2, 8, 4)
STATE = LayoutSpec(2, 1, (4, 3), DType.FLOAT32, ("ssm",))


# -- hit rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("present", "expected"),
    [([], 0), ([F], 0), ([T, T, F, T], 2), ([T, T, T], 3), ([F, T, T], 0)],
)
def test_all_pages_needs_every_page_from_the_start(present: list[bool], expected: int) -> None:
    assert usable_prefix(ALL_PAGES, present) == expected


def test_swa_hit_without_its_window_pages_is_no_hit() -> None:
    window = HitRule.trailing(2)
    # Only the first pages are held: the window before any end >= 3 is missing.
    assert usable_prefix(window, [T, T, F, F]) == 2
    # Each held page is alone: no end has both window pages.
    assert usable_prefix(window, [F, T, F, T]) == 0
    # The last two pages are enough, whatever is missing before them.
    assert usable_prefix(window, [F, F, T, T]) == 4
    assert usable_ends(window, [T, T, F, T, T, F]) == [T, T, T, F, F, T, F]


def test_swa_prefix_shorter_than_the_window_needs_all_its_pages() -> None:
    assert usable_ends(HitRule.trailing(3), [T, T]) == [T, T, T]
    assert usable_ends(HitRule.trailing(3), [F, T]) == [T, F, F]


def test_hybrid_hit_ends_where_a_state_snapshot_exists() -> None:
    assert usable_prefix(STATE_AT_END, [F, T, F, T, F]) == 4
    assert usable_prefix(STATE_AT_END, [F, F, F]) == 0
    assert usable_ends(STATE_AT_END, [T, F, T]) == [T, T, F, T]


def test_common_prefix_is_the_longest_end_usable_by_every_pool() -> None:
    kv = (ALL_PAGES, [T] * 6)
    swa = (HitRule.trailing(2), [F, F, T, T, F, F])  # usable ends {0, 4}
    state = (STATE_AT_END, [F, F, T, F, T, F])  # usable ends {0, 3, 5}
    # The minimum of each pool's best (4) would be wrong: no snapshot exists at 4.
    assert common_usable_prefix([kv, swa, state]) == 0
    assert common_usable_prefix([kv, (STATE_AT_END, [F, F, F, T, F, F]), swa]) == 4
    assert common_usable_prefix([(ALL_PAGES, [T, T, F]), (STATE_AT_END, [T, T, T])]) == 2


def test_common_prefix_rejects_uneven_or_empty_input() -> None:
    with pytest.raises(InvalidArgumentError):
        common_usable_prefix([(ALL_PAGES, [T]), (ALL_PAGES, [T, T])])
    with pytest.raises(InvalidArgumentError):
        common_usable_prefix([])


def _brute_force(rule: HitRule, present: tuple[bool, ...], n: int) -> bool:
    if rule.kind is HitRuleKind.ALL_PAGES:
        return all(present[:n])
    if rule.kind is HitRuleKind.TRAILING_PAGES:
        return all(present[max(0, n - rule.pages) : n])
    return n == 0 or present[n - 1]


def test_usable_ends_matches_the_definition_on_every_short_input() -> None:
    rules = [ALL_PAGES, STATE_AT_END, *(HitRule.trailing(k) for k in (1, 2, 3))]
    for length in range(7):
        for present in itertools.product([F, T], repeat=length):
            for rule in rules:
                want = [_brute_force(rule, present, n) for n in range(length + 1)]
                assert usable_ends(rule, present) == want, (rule, present)


def test_hit_rules_read_entries_by_truth_on_long_inputs() -> None:
    """Entries count by their truth (0/1, None, a 0-d tensor), as the per-page loop read them,
    and long prefixes (hundreds of pages, a long cached prompt) give the definition's answer."""
    assert usable_ends(ALL_PAGES, [1, 1, 0, 1]) == [T, T, T, F, F]
    assert usable_ends(ALL_PAGES, [torch.tensor(True), None]) == [T, T, F]
    rng = random.Random(0)
    rules = [ALL_PAGES, STATE_AT_END, HitRule.trailing(4)]
    for _ in range(50):
        length = rng.randrange(0, 400)
        cut = rng.randrange(0, length + 1)
        present = [T] * cut + [rng.random() < 0.8 for _ in range(length - cut)]
        for rule in rules:
            want = [_brute_force(rule, tuple(present), n) for n in range(length + 1)]
            assert usable_ends(rule, present) == want
            assert usable_prefix(rule, present) == max(n for n, ok in enumerate(want) if ok)
        pools = [(ALL_PAGES, present), (STATE_AT_END, [rng.random() < 0.3 for _ in present])]
        both = [
            _brute_force(ALL_PAGES, tuple(present), n)
            and _brute_force(STATE_AT_END, tuple(pools[1][1]), n)
            for n in range(length + 1)
        ]
        assert common_usable_prefix(pools) == max(n for n, ok in enumerate(both) if ok)


def test_hit_rule_validation_and_window() -> None:
    for bad in (
        lambda: HitRule.trailing(0),
        lambda: HitRule(HitRuleKind.TRAILING_PAGES, True),
        lambda: HitRule(HitRuleKind.ALL_PAGES, 1),
        lambda: HitRule("all_pages"),  # type: ignore[arg-type]
        lambda: HitRule.window(0, 4),
    ):
        with pytest.raises(InvalidArgumentError):
            bad()
    assert HitRule.window(8, 4) == HitRule.trailing(2)
    assert HitRule.window(9, 4).pages == 3
    assert HitRule.window(1, 4).pages == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALL_PAGES.pages = 3  # type: ignore[misc]


# -- specs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kv", "a", "x" * 16, "ssm_0", "k.v-1", "_idx"])
def test_good_pool_names(name: str) -> None:
    assert validate_pool_name(name) == name
    assert PageMeta(pool=name, dtype=DType.UINT8, shape=(1,)).pool == name


@pytest.mark.parametrize("name", ["", "x" * 17, "a/b", "é", ".x", "-x", "a\0", "a b", 3, None])
def test_bad_pool_names(name: object) -> None:
    with pytest.raises(InvalidArgumentError):
        validate_pool_name(name)
    with pytest.raises(InvalidArgumentError):
        PoolSpec(name, KV)  # type: ignore[arg-type]


def test_pool_spec_rules_match_granularity() -> None:
    seq = Granularity.PER_SEQUENCE
    with pytest.raises(InvalidArgumentError):
        PoolSpec("ssm", STATE, ALL_PAGES, seq)
    with pytest.raises(InvalidArgumentError):
        PoolSpec("kv", KV, STATE_AT_END)
    with pytest.raises(LayoutError):
        PoolSpec("ssm", KV, STATE_AT_END, seq)  # a snapshot is one page of page_size 1
    with pytest.raises(InvalidArgumentError):
        PoolSpec("kv", KV, shares_slots_with="kv")
    with pytest.raises(LayoutError):
        PoolSpec("kv", "layout")  # type: ignore[arg-type]
    spec = PoolSpec("ssm", STATE, STATE_AT_END, seq)
    assert (spec.page_size, spec.page_bytes) == (1, STATE.page_bytes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_model_pools_validation() -> None:
    kv = PoolSpec("kv", KV)
    seq = Granularity.PER_SEQUENCE
    cases = [
        (),  # no pools
        (kv, kv),  # duplicate names
        (PoolSpec("kv", LayoutSpec.mha(2, 2, 8, 8)),),  # page size differs from the model's
        (kv, PoolSpec("idx", KV, shares_slots_with="nope")),  # unknown owner
        (
            kv,
            PoolSpec("a", KV, shares_slots_with="kv"),
            PoolSpec("b", KV, shares_slots_with="a"),  # a chain
        ),
        (kv, PoolSpec("ssm", STATE, STATE_AT_END, seq, shares_slots_with="kv")),
    ]
    for pools in cases:
        with pytest.raises(InvalidArgumentError):
            ModelPools("m", 4, pools)
    model = ModelPools("m", 4, (kv, PoolSpec("idx", KV, shares_slots_with="kv")))
    assert model.names == ("kv", "idx")
    assert [p.name for p in model.sidecars("kv")] == ["idx"]
    assert model.pool("idx").shares_slots_with == "kv"
    with pytest.raises(InvalidArgumentError):
        model.pool("missing")


# -- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PoolPreset))
def test_every_preset_is_a_valid_set_of_pools(name: PoolPreset) -> None:
    model = preset(name)
    assert model.name == name.value and len(model) >= 1
    for spec in model:
        assert spec.layout.layers >= 1
        for layout in (Layout.PAGE_FIRST, Layout.LAYER_FIRST):
            shape = page_shape(spec.layout, layout)
            meta = PageMeta(spec.name, spec.layout.dtype, shape, layout)
            assert meta.nbytes == spec.page_bytes


def test_dense_preset() -> None:
    shape = ModelShape(layers=3, heads=4, head_dim=8, page_size=2, dtype=DType.FLOAT16)
    (kv,) = preset(PoolPreset.DENSE, shape).pools
    assert kv.layout == LayoutSpec.mha(3, 4, 8, 2, DType.FLOAT16)
    assert (kv.hit_rule, kv.replicated_across_tp, kv.shares_slots_with) == (ALL_PAGES, F, None)


def test_mla_preset_is_one_replicated_latent() -> None:
    (latent,) = preset(PoolPreset.MLA, ModelShape(latent_dim=40)).pools
    assert latent.layout.components == ("latent",)
    assert latent.layout.item_shape == (1, 40)
    assert latent.replicated_across_tp and latent.hit_rule == ALL_PAGES


def test_dsa_preset_adds_the_indexer_on_the_latent_slots() -> None:
    model = preset(PoolPreset.DSA, ModelShape(index_dim=128))
    latent, indexer = model.pools
    assert latent.name == "latent" and indexer.shares_slots_with == "latent"
    assert indexer.layout.dtype is DType.UINT8
    assert indexer.layout.item_shape == (128 + 4,)  # fp8 key bytes, then an fp32 scale
    assert indexer.hit_rule == ALL_PAGES and indexer.replicated_across_tp


def test_swa_preset_window_and_full_layers() -> None:
    model = preset(PoolPreset.SWA, ModelShape(window=9, page_size=4, layers=3, full_layers=1))
    assert model.names == ("kv", "swa")
    assert model.pool("swa").hit_rule == HitRule.trailing(3)
    assert (model.pool("kv").layout.layers, model.pool("swa").layout.layers) == (1, 3)
    only = preset(PoolPreset.SWA, ModelShape(full_layers=0))
    assert only.names == ("swa",)
    with pytest.raises(InvalidArgumentError):
        preset(PoolPreset.SWA, ModelShape(window=0))


def test_hybrid_preset_snapshots_conv_and_ssm_state() -> None:
    shape = ModelShape(recurrent_layers=3, conv_shape=(6, 3), ssm_shape=(2, 4, 5))
    model = preset(PoolPreset.HYBRID, shape)
    assert model.names == ("kv", "conv", "ssm")
    conv, ssm = model.pool("conv"), model.pool("ssm")
    for spec in (conv, ssm):
        assert spec.granularity is Granularity.PER_SEQUENCE
        assert spec.hit_rule == STATE_AT_END and spec.page_size == 1
        assert spec.layout.layers == 3
    assert conv.layout.item_shape == (6, 3) and ssm.layout.item_shape == (2, 4, 5)
    assert ssm.layout.dtype is DType.FLOAT32 and ssm.shares_slots_with == "conv"
    assert model.pool("kv").granularity is Granularity.PER_TOKEN


def test_preset_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        preset("dense")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        preset(PoolPreset.DENSE, {"layers": 2})  # type: ignore[arg-type]
    with pytest.raises(LayoutError):
        preset(PoolPreset.DENSE, ModelShape(heads=0))


def test_dsv4_preset_compresses_into_the_token_slots() -> None:
    model = preset(PoolPreset.DSV4)
    assert model.names == ("c4", "indexer", "c128", "swa")
    c4, indexer, c128, swa = model.pools
    # Three lifecycles: c4 (the indexer on its slots), c128 and swa each own their slots.
    assert (indexer.shares_slots_with, c128.shares_slots_with, swa.shares_slots_with) == (
        "c4", None, None,
    )  # fmt: skip
    assert model.sidecars("c4") == (indexer,) and c128.hit_rule == ALL_PAGES
    shape = ModelShape()
    # A page of 128 tokens: 32 C4 entries and one C128 entry per layer.
    assert c4.page_bytes == shape.layers * 32 * shape.c4_dim * 2
    assert c128.page_bytes == shape.layers * 1 * shape.c128_dim * 2
    assert swa.hit_rule == HitRule.trailing(1) and c4.hit_rule == ALL_PAGES
    for bad in (
        ModelShape(page_size=64, window=128),
        ModelShape(page_size=128, window=64),
        ModelShape(page_size=128, window=128, c4_dim=30),
    ):
        with pytest.raises(InvalidArgumentError):
            preset(PoolPreset.DSV4, bad)
