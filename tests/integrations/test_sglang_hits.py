"""How much of a prefix SGLang can restore when side pools come with the KV (sglang.hits).

A brute-force reference checks every prefix length against each policy's rule as SGLang states
it (``PoolHitPolicy``); hypothesis compares it with ``restorable_prefix`` over random presence
lists, windows and pool orders; a few hand cases pin the examples worth reading.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.integrations.sglang.hits import HitPolicy, PoolQuery, PrefixVerdict, restorable_prefix

KV = "kv"
T, F = True, False


# ----- the reference ------------------------------------------------------------------------
def _kv_prefix(kv_present: Sequence[bool]) -> int:
    """Leading KV pages stored, counted one by one."""
    count = 0
    while count < len(kv_present) and kv_present[count]:
        count += 1
    return count


def _pool_allows(pool: PoolQuery, length: int) -> bool:
    """Whether ``pool`` can restore a prefix of ``length`` pages: the rule, literally."""
    if pool.policy is HitPolicy.BLOCK_GROUPS:
        return True  # never a limit on the KV prefix
    if pool.policy is HitPolicy.ALL_PAGES:
        return all(pool.present[:length])
    window = max(1, pool.window)  # SGLang: max(1, len(transfer.keys))
    return all(pool.present[max(0, length - window) : length])


def _reference(kv_present: Sequence[bool], pools: Sequence[PoolQuery]) -> PrefixVerdict:
    kv_pages = _kv_prefix(kv_present)
    lengths = range(1, kv_pages + 1)
    restorable = [n for n in lengths if all(_pool_allows(p, n) for p in pools)]
    hits = {KV: kv_pages} if kv_pages else {}
    still_open = list(lengths)
    for pool in pools:
        # SGLang stops asking pools once no length is left (its FileStorage does the same),
        # so a pool after that point reports nothing.
        if not still_open:
            break
        if pool.policy is HitPolicy.BLOCK_GROUPS:
            continue
        own = [n for n in lengths if _pool_allows(pool, n)]
        if own:
            hits[pool.name] = max(own)
        still_open = [n for n in still_open if _pool_allows(pool, n)]
    return PrefixVerdict(max(restorable, default=0), hits, restorable)


def _check(kv_present: Sequence[bool], pools: Sequence[PoolQuery]) -> PrefixVerdict:
    got = restorable_prefix(KV, kv_present, pools)
    want = _reference(kv_present, pools)
    assert got.restorable == want.restorable
    assert got.kv_pages == want.kv_pages
    assert dict(got.hits) == dict(want.hits)
    return got


# ----- random cases -------------------------------------------------------------------------
@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[bool], list[PoolQuery]]:
    pages = draw(st.integers(0, 10))
    # Mostly stored pages, so that long prefixes and gaps late in them both come up.
    present = st.lists(st.booleans() | st.just(True), min_size=pages, max_size=pages)
    kv_present = draw(present)
    pools = [
        PoolQuery(f"pool{i}", draw(st.sampled_from(list(HitPolicy))), draw(present), window)
        for i, window in enumerate(draw(st.lists(st.integers(0, 6), max_size=3)))
    ]
    return kv_present, pools


@settings(max_examples=400, deadline=None)
@given(_cases())
def test_matches_the_rule_for_every_prefix_length(case: tuple[list[bool], list[PoolQuery]]) -> None:
    verdict = _check(*case)
    # Whatever the pools, the verdict is consistent with itself.
    assert verdict.kv_pages == (verdict.restorable[-1] if verdict.restorable else 0)
    assert all(n <= verdict.hits.get(KV, 0) for n in verdict.restorable)


# ----- hand cases ---------------------------------------------------------------------------
def test_trailing_window_restores_lengths_after_a_gap() -> None:
    swa = PoolQuery("swa", HitPolicy.TRAILING_PAGES, [T, T, F, T, T, T], window=2)
    verdict = _check([T] * 6, [swa])
    # 3 and 4 end within 2 pages of the gap at page 2; 1 needs only its one page.
    assert verdict.restorable == [1, 2, 5, 6]
    assert verdict.kv_pages == 6
    assert dict(verdict.hits) == {KV: 6, "swa": 6}


def test_trailing_window_of_one_needs_only_the_last_page() -> None:
    mamba = PoolQuery("mamba", HitPolicy.TRAILING_PAGES, [F, F, T, F], window=1)
    verdict = _check([T] * 4, [mamba])
    assert verdict.restorable == [3]
    assert dict(verdict.hits) == {KV: 4, "mamba": 3}


@pytest.mark.parametrize("window", [0, -2])
def test_trailing_window_below_one_counts_as_one(window: int) -> None:
    pool = PoolQuery("mamba", HitPolicy.TRAILING_PAGES, [F, T, F], window=window)
    assert _check([T] * 3, [pool]).restorable == [2]


def test_all_pages_stops_at_the_first_missing_page() -> None:
    dsa = PoolQuery("dsa", HitPolicy.ALL_PAGES, [T, T, T, F, T])
    verdict = _check([T] * 5, [dsa])
    assert verdict.restorable == [1, 2, 3]
    assert verdict.kv_pages == 3
    assert dict(verdict.hits) == {KV: 5, "dsa": 3}


def test_all_pages_missing_the_first_page_restores_nothing() -> None:
    dsa = PoolQuery("dsa", HitPolicy.ALL_PAGES, [F, T, T])
    verdict = _check([T] * 3, [dsa])
    assert (verdict.kv_pages, verdict.restorable, dict(verdict.hits)) == (0, [], {KV: 3})


def test_side_pools_never_reach_past_the_kv_prefix() -> None:
    dsa = PoolQuery("dsa", HitPolicy.ALL_PAGES, [T] * 5)
    swa = PoolQuery("swa", HitPolicy.TRAILING_PAGES, [T] * 5, window=2)
    verdict = _check([T, T, F, T, T], [dsa, swa])
    assert verdict.restorable == [1, 2]
    assert dict(verdict.hits) == {KV: 2, "dsa": 2, "swa": 2}


def test_block_groups_never_limit_the_kv_prefix_and_report_no_hit() -> None:
    blocks = PoolQuery("c4", HitPolicy.BLOCK_GROUPS, [F] * 4, window=3)
    verdict = _check([T] * 4, [blocks])
    assert verdict.restorable == [1, 2, 3, 4]
    assert dict(verdict.hits) == {KV: 4}  # its geometry is unknown: no hit, never a wrong one


def test_an_empty_kv_prefix_has_no_pages_and_no_hits() -> None:
    dsa = PoolQuery("dsa", HitPolicy.ALL_PAGES, [T, T, T])
    for kv_present in ([], [F, T, T]):
        verdict = _check(kv_present, [dsa])
        assert (verdict.kv_pages, verdict.restorable, dict(verdict.hits)) == (0, [], {})


def test_pools_intersect() -> None:
    dsa = PoolQuery("dsa", HitPolicy.ALL_PAGES, [T, T, T, T, T, F])
    swa = PoolQuery("swa", HitPolicy.TRAILING_PAGES, [T, T, F, T, T, T], window=2)
    verdict = _check([T] * 6, [dsa, swa])
    assert verdict.restorable == [1, 2, 5]  # swa's [1, 2, 5, 6] within dsa's [1..5]
    assert dict(verdict.hits) == {KV: 6, "dsa": 5, "swa": 6}


def test_pools_after_nothing_is_left_report_nothing() -> None:
    # SGLang's own rule: once no length is restorable the remaining pools are not asked.
    empty = PoolQuery("dsa", HitPolicy.ALL_PAGES, [F, T])
    full = PoolQuery("swa", HitPolicy.TRAILING_PAGES, [T, T], window=1)
    assert dict(_check([T, T], [empty, full]).hits) == {KV: 2}
    assert dict(_check([T, T], [full, empty]).hits) == {KV: 2, "swa": 2}


def test_policies_parse_from_sglangs_values() -> None:
    # The adapter builds HitPolicy from SGLang's PoolHitPolicy values.
    values = {"all_pages", "trailing_pages", "block_groups"}
    assert {HitPolicy(value).value for value in values} == values
