"""Pure helpers of :class:`~hicache.radix.shadow.ShadowRadixCache` and its
:class:`~hicache.radix.pool_ledger.PoolLedger`: pool roles, input checks, per-page presence along
a path, and the token range a pool lock covers.

Representations (shared with the tree and its ledger):

* a *token pool* (an extra per-token owner pool: SWA K/V under a window rule, dsv4's ``c128``
  under ALL_PAGES) holds, per node, a 1-D int64 tensor of the span's slots, or ``None`` once
  dropped. A caller passes (and a match returns) one tensor of
  ``len(key)`` slots where ``-1`` marks a token the pool does not hold; held-ness is per page.
* a *state pool* (an extra per-sequence owner pool: conv state) holds, per node, a 1-element int64
  tensor with the slot of the snapshot taken at the node's end, or ``None``.
* sidecars (``shares_slots_with``) hold nothing of their own: their owner's slots address them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.pools.pool_spec import Granularity, HitRule, HitRuleKind, ModelPools
from hicache.radix.node import TreeNode
from hicache.radix.packing import common_prefix_bytes

__all__ = [
    "PoolRoles",
    "check_pool_values",
    "device_held",
    "holds_nothing",
    "lock_start",
    "path_presence",
    "peek_path",
    "pool_indices",
    "pool_roles",
]


@dataclass(frozen=True, slots=True)
class PoolRoles:
    """Which pool plays which part in the tree."""

    anchor: str  # the tree's ``value``: node existence follows this pool
    token_pools: tuple[str, ...]  # extra per-token owner pools, data per node span
    state_pools: tuple[str, ...]  # extra per-sequence owner pools, a snapshot per node end
    owner_of: Mapping[str, str]  # every pool -> the pool owning its slots (itself for owners)
    rules: Mapping[str, HitRule]

    @property
    def extra(self) -> tuple[str, ...]:
        return self.token_pools + self.state_pools

    @property
    def windows(self) -> tuple[str, ...]:
        """The token pools under a trailing-window rule (SWA); the others need every page."""
        trailing = HitRuleKind.TRAILING_PAGES
        return tuple(n for n in self.token_pools if self.rules[n].kind is trailing)

    def owner(self, name: object) -> str:
        """The owner of pool ``name``; a typed error for a name the model does not have."""
        if not isinstance(name, str) or name not in self.owner_of:
            raise InvalidArgumentError(f"no pool {name!r}; this model has {tuple(self.owner_of)}")
        return self.owner_of[name]

    def extra_owner(self, name: object) -> str:
        """The extra owner pool behind ``name``; the anchor is refused (it is the tree lock)."""
        owner = self.owner(name)
        if owner == self.anchor:
            raise InvalidArgumentError(
                f"pool {name!r} lives in the anchor pool {self.anchor!r}: use the tree's lock "
                "and evict()"
            )
        return owner


def pool_roles(pools: ModelPools) -> PoolRoles:
    """Split ``pools`` into the anchor, token pools and state pools."""
    if not isinstance(pools, ModelPools):
        raise ConfigError(f"pools must be a ModelPools, got {type(pools).__name__}")
    owners = [p for p in pools if p.shares_slots_with is None]
    anchors = [p for p in owners if p.hit_rule.kind is HitRuleKind.ALL_PAGES]
    if not anchors or anchors[0].granularity is not Granularity.PER_TOKEN:
        raise ConfigError(f"model {pools.name!r} has no per-token ALL_PAGES pool to anchor a tree")
    anchor = anchors[0].name
    rest = [p for p in owners if p.name != anchor]
    return PoolRoles(
        anchor=anchor,
        token_pools=tuple(p.name for p in rest if p.granularity is Granularity.PER_TOKEN),
        state_pools=tuple(p.name for p in rest if p.granularity is Granularity.PER_SEQUENCE),
        owner_of={p.name: p.shares_slots_with or p.name for p in pools},
        rules=pools.hit_rules,
    )


def _as_slots(name: str, raw: object) -> torch.Tensor:
    try:
        slots = torch.as_tensor(raw)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"pool {name!r}: slots must be a tensor of ints: {exc}"
        ) from None
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise InvalidArgumentError(f"pool {name!r}: slots must be integers, got {slots.dtype}")
    if slots.dim() != 1:
        raise InvalidArgumentError(f"pool {name!r}: slots must be 1-D, got shape {slots.shape}")
    return slots.to(torch.int64)


def _check_token_slots(name: str, slots: torch.Tensor, key_len: int, page_size: int) -> None:
    if len(slots) != key_len:
        raise InvalidArgumentError(
            f"pool {name!r}: a key of {key_len} units with {len(slots)} slots"
        )
    if bool((slots < -1).any()):
        raise InvalidArgumentError(f"pool {name!r}: slots are >= 0, or -1 for a token not held")
    whole = key_len - key_len % page_size
    pages = (slots[:whole] >= 0).reshape(-1, page_size)
    if bool((pages.any(dim=1) != pages.all(dim=1)).any()):
        raise InvalidArgumentError(f"pool {name!r}: a page is held whole or not at all")


def check_pool_values(
    roles: PoolRoles, pool_values: object, key_len: int, page_size: int
) -> dict[str, torch.Tensor]:
    """``pool_values`` checked against the key and converted to int64 tensors; changes nothing."""
    if pool_values is None:
        return {}
    if not isinstance(pool_values, Mapping):
        raise InvalidArgumentError("pool_values must be a mapping of pool name to slots")
    out: dict[str, torch.Tensor] = {}
    for name, raw in pool_values.items():
        if roles.extra_owner(name) != name:
            raise InvalidArgumentError(
                f"pool {name!r} shares the slots of {roles.owner_of[name]!r}: pass those"
            )
        if raw is None:
            continue
        slots = _as_slots(name, raw)
        if name in roles.token_pools:
            _check_token_slots(name, slots, key_len, page_size)
        else:
            if len(slots) != 1 or int(slots[0]) < 0:
                raise InvalidArgumentError(f"pool {name!r}: a snapshot is one slot >= 0")
            if key_len % page_size:
                raise InvalidArgumentError(
                    f"pool {name!r}: a snapshot needs a page-aligned key, got {key_len} units"
                )
        out[name] = slots
    return out


def device_held(node: TreeNode, pool: str) -> bool:
    """Whether ``node`` holds ``pool``'s data in the tree's own memory (the device)."""
    values = node.pool_values
    return values is not None and values.get(pool) is not None


def holds_nothing(node: TreeNode) -> bool:
    """Whether ``node`` is a leaf that no lock holds and no pool has data on, on any tier (the
    tree lets it go)."""
    if node.value is not None or node.host_value is not None or node.children or node.lock_ref:
        return False
    for per_pool in (node.pool_values, node.pool_host):
        if any(data is not None for data in (per_pool or {}).values()):
            return False
    return not any((node.pool_locks or {}).values())


HeldTest = Callable[[TreeNode, str], bool]


def path_presence(
    roles: PoolRoles,
    nodes: Sequence[TreeNode],
    page_size: int,
    last_units: int,
    held_extra: HeldTest = device_held,
    held_anchor: Callable[[TreeNode], bool] = lambda n: n.value is not None,
) -> list[tuple[HitRule, list[bool]]]:
    """Each pool's hit rule with its per-page ``present`` list along ``nodes``.

    The last node counts only its first ``last_units`` units (a match may end inside it); a
    snapshot there is at the node's end, so it serves only when the node is wholly matched.
    ``held_anchor`` and ``held_extra`` say where data counts as present (default: the device;
    the tiered cache also asks about the host).
    """
    held: dict[str, list[bool]] = {name: [] for name in roles.owner_of.values()}
    for i, node in enumerate(nodes):
        units = last_units if i == len(nodes) - 1 else node.length
        pages = units // page_size
        held[roles.anchor] += [held_anchor(node)] * pages
        for name in roles.token_pools:
            held[name] += [held_extra(node, name)] * pages
        for name in roles.state_pools:
            at_end = units == node.length and held_extra(node, name)
            held[name] += [False] * (pages - 1) + [at_end] if pages else []
    return [(roles.rules[name], held[owner]) for name, owner in roles.owner_of.items()]


def peek_path(root: TreeNode | None, data: bytes, page_bytes: int) -> tuple[list[TreeNode], int]:
    """The nodes ``data`` reaches from ``root`` without touching them, and how many bytes of
    the last one it matches (the match may end inside it)."""
    node, pos, last = root, 0, 0
    path: list[TreeNode] = []
    while node is not None and pos < len(data):
        child = node.children.get(data[pos : pos + page_bytes])
        if child is None:
            break
        path.append(child)
        if not data.startswith(child.key, pos):
            last = common_prefix_bytes(child.key, data, pos, page_bytes)
            break
        last = len(child.key)
        pos += last
        node = child
    return path, last


def pool_indices(
    roles: PoolRoles, path: Sequence[TreeNode], anchor: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    """Each non-anchor pool's slots for the prefix ``path`` covers (see ShadowMatchResult)."""
    own: dict[str, torch.Tensor | None] = {roles.anchor: anchor}
    for name in roles.token_pools:
        parts = []
        for node in path:
            data = (node.pool_values or {}).get(name)
            parts.append(torch.full((node.length,), -1) if data is None else data)
        own[name] = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    for name in roles.state_pools:
        own[name] = (path[-1].pool_values or {}).get(name) if path else None
    return {name: own[owner] for name, owner in roles.owner_of.items() if name != roles.anchor}


def lock_start(roles: PoolRoles, pool: str, end: int, page_size: int, pages: int | None) -> int:
    """Where a lock of ``pool`` on a path ending at unit ``end`` begins (units from the root).

    A node is held by the lock when it ends after this point, so a whole node is held when the
    window starts inside it. A state lock holds only the node that ends at ``end``.
    """
    if pages is not None and (isinstance(pages, bool) or not isinstance(pages, int) or pages < 1):
        raise InvalidArgumentError(f"pages must be a positive int or None, got {pages!r}")
    if pool in roles.state_pools:
        if pages is not None:
            raise InvalidArgumentError(f"pool {pool!r} holds one snapshot: it takes no pages")
        return max(0, end - 1)
    rule = roles.rules[pool]
    if pages is None:
        pages = rule.pages if rule.kind is HitRuleKind.TRAILING_PAGES else None
    return 0 if pages is None else max(0, end - pages * page_size)
