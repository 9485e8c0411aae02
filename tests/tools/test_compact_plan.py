"""The compact planner on synthetic trees: orphans, and LRU eviction that never cuts a chain."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.backends.base import ObjectInfo
from hicache.codec import NO_PARENT, PageMeta, encode_page, parse_header
from hicache.dtypes import DType
from hicache.tools.store.compact_plan import Budget, Reason, StorePlanner
from hicache.tools.store.scan import ScannedObject

NS, FMT = "ab" * 8, "cd" * 8
NOW = 1_000_000.0


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def key_of(name: str) -> str:
    return f"{NS}-{FMT}-{digest(name).hex()}"


def page(name: str, parent: str | None, mtime: float, size: int = 100) -> ScannedObject:
    key = key_of(name)
    meta = PageMeta("kv", DType.UINT8, (4,), parent_hash=digest(parent) if parent else NO_PARENT)
    header = parse_header(key, bytes(encode_page(key, b"abcd", meta)[0]))
    return ScannedObject(ObjectInfo(key, size, mtime), header)


def plan(pages: list[ScannedObject], **budget: float) -> dict[str, Reason]:
    planner = StorePlanner()
    for p in pages:
        planner.add(p)
    removals = planner.plan(Budget(NOW, grace_s=10, **budget))  # type: ignore[arg-type]
    return {r.key: r.reason for r in removals}


def test_orphans_below_a_missing_page() -> None:
    # root -> a -> b -> c, and a second branch a -> d; "a" is missing.
    pages = [page("root", None, 1), page("b", "a", 1), page("c", "b", 1), page("d", "a", 1)]
    assert plan(pages) == {key_of(n): Reason.ORPHAN for n in "bcd"}


def test_a_shared_prefix_lives_as_long_as_its_newest_branch() -> None:
    # p -> a -> b (old) and p -> c (new): evicting two pages takes b then a, never p.
    pages = [page("p", None, 10), page("a", "p", 20), page("b", "a", 30), page("c", "p", 90)]
    removed = plan(pages, max_bytes=200)
    assert list(removed) == [key_of("b"), key_of("a")]
    assert set(removed.values()) == {Reason.OVER_BUDGET}
    assert plan(pages, max_age_s=NOW - 50) == {
        key_of("b"): Reason.EXPIRED,
        key_of("a"): Reason.EXPIRED,
    }


def test_a_cycle_is_an_orphan() -> None:
    pages = [page("x", "y", 1), page("y", "x", 1), page("ok", None, 1)]
    assert plan(pages) == {key_of("x"): Reason.ORPHAN, key_of("y"): Reason.ORPHAN}


@st.composite
def forests(draw: st.DrawFn) -> list[tuple[str, str | None, float, int]]:
    n = draw(st.integers(1, 40))
    nodes: list[tuple[str, str | None, float, int]] = []
    for i in range(n):
        parent = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        mtime = draw(st.integers(0, 50)) * 1.0
        size = draw(st.integers(1, 500))
        nodes.append((f"n{i}", None if parent is None else f"n{parent}", mtime, size))
    return nodes


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(forests(), st.integers(0, 20_000))
def test_budget_eviction_is_lru_and_never_cuts_a_chain(
    nodes: list[tuple[str, str | None, float, int]], max_bytes: int
) -> None:
    planner = StorePlanner()
    for name, parent, mtime, size in nodes:
        planner.add(page(name, parent, mtime, size))
    removals = planner.plan(Budget(NOW, max_bytes=max_bytes))
    gone = [r.key for r in removals]
    assert all(r.reason is Reason.OVER_BUDGET for r in removals)
    parent_of = {key_of(n): key_of(p) if p else None for n, p, _, _ in nodes}
    # No surviving page lost its parent, and every page goes after all its children.
    position = {k: i for i, k in enumerate(gone)}
    for child, parent in parent_of.items():
        if parent is not None and parent in position:
            assert child in position and position[child] < position[parent]
    kept = sum(size for n, _, _, size in nodes if key_of(n) not in position)
    assert kept <= max_bytes
    # Nothing more than needed: the last page evicted (in LRU order, not the depth-first order
    # of deletion) has no evicted parent, and putting it back would break the budget.
    size_of = {key_of(n): size for n, _, _, size in nodes}
    tops = [k for k in gone if parent_of[k] not in position]
    assert not gone or any(kept + size_of[k] > max_bytes for k in tops)
