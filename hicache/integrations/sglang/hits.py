"""How many pages of a prefix SGLang can restore when side pools must come with the KV.

Pure functions over "is page i of pool p stored" answers, so the hit policies are tested
without a backend. The rules are SGLang's (``PoolHitPolicy``):

- ``all_pages``: every page of the prefix must be there (a DSA indexer page per KV page);
- ``trailing_pages``: only the last ``window`` pages before the prefix's end (SWA windows,
  Mamba state saved at node ends);
- ``block_groups``: the pool's own verdict, never a limit on the KV prefix. Its geometry is not
  used by any SGLang 0.5.23 producer, so it is reported as no hit (never a wrong one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = ["HitPolicy", "PoolQuery", "PrefixVerdict", "restorable_prefix"]


class HitPolicy(Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass(frozen=True, slots=True)
class PoolQuery:
    """One side pool's answers: ``present[i]`` for the i-th KV page's key."""

    name: str
    policy: HitPolicy
    present: Sequence[bool]
    window: int = 1  # trailing_pages: how many pages before a prefix's end must be there


@dataclass(frozen=True, slots=True)
class PrefixVerdict:
    kv_pages: int  # the usable prefix, in pages
    hits: Mapping[str, int]  # per pool (the KV pool under its own name), pages found
    restorable: list[int]  # every prefix length (pages) that all pools can restore


def restorable_prefix(
    kv_name: str, kv_present: Sequence[bool], pools: Sequence[PoolQuery]
) -> PrefixVerdict:
    """The longest prefix every pool can restore, and each pool's own count."""
    kv_pages = next((i for i, ok in enumerate(kv_present) if not ok), len(kv_present))
    hits: dict[str, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = set(range(1, kv_pages + 1))
    for pool in pools:
        if not restorable:
            break
        if pool.policy is HitPolicy.BLOCK_GROUPS:
            continue
        if pool.policy is HitPolicy.ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not pool.present[i]), kv_pages)
            allowed = set(range(1, boundary + 1))
        else:
            allowed = _trailing_restorable(pool.present, kv_pages, max(1, pool.window))
            boundary = max(allowed, default=0)
        if boundary:
            hits[pool.name] = boundary
        restorable &= allowed
    ordered = sorted(restorable)
    return PrefixVerdict(ordered[-1] if ordered else 0, hits, ordered)


def _trailing_restorable(present: Sequence[bool], kv_pages: int, window: int) -> set[int]:
    """Prefix lengths whose last ``window`` pages (fewer at the start) are all stored."""
    allowed: set[int] = set()
    run = 0  # stored pages ending at the current page, without a gap
    for length in range(1, kv_pages + 1):
        run = run + 1 if present[length - 1] else 0
        if run >= min(window, length):
            allowed.add(length)
    return allowed
