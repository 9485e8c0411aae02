"""What a prefetch reads: the L3 hit by every pool's hit rule, and per page the pools it needs.

Pure: the storage tier passes which objects L3 holds for each candidate page (by pool name), and
gets back how many leading pages are usable and, for each of them, the pools to read. A pool is
held on a page when every pool of its group is (a sidecar's object beside its owner's). Pages
before the first candidate are in the tree already and count as held by every pool, so a window
that reaches back before the candidates is taken to be there (the tree's own hit rules decide
again when the request is matched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.pools.pool_spec import HitRuleKind, common_usable_prefix
from hicache.radix.shadow_rules import PoolRoles

__all__ = ["plan_reads"]


def plan_reads(
    roles: PoolRoles, found: Sequence[Mapping[str, bool]]
) -> tuple[int, list[frozenset[str]]]:
    """(usable pages, per usable page the pools to read: the owners and their sidecars)."""
    groups: dict[str, list[str]] = {}
    for name, owner in roles.owner_of.items():
        groups.setdefault(owner, []).append(name)
    held = {
        owner: [all(page.get(name, False) for name in members) for page in found]
        for owner, members in groups.items()
    }
    hit = common_usable_prefix([(roles.rules[owner], held[owner]) for owner in groups])
    reads: list[set[str]] = [set() for _ in range(hit)]
    for owner, members in groups.items():
        for i in _needed_pages(roles, owner, hit):
            reads[i].update(members)
    return hit, [frozenset(r) for r in reads]


def _needed_pages(roles: PoolRoles, owner: str, hit: int) -> range:
    """The pages of a ``hit``-page prefix whose ``owner`` data the prefix needs."""
    if hit == 0:
        return range(0)
    if owner in roles.state_pools:
        return range(hit - 1, hit)
    rule = roles.rules[owner]
    if rule.kind is HitRuleKind.TRAILING_PAGES:
        return range(max(0, hit - rule.pages), hit)
    return range(hit)
