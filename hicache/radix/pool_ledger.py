"""PoolLedger: what each extra pool of a :class:`~hicache.radix.shadow.ShadowRadixCache` holds on
each node, which pool locks hold it, and exact per-pool counts.

The tree owns one ledger (``tree.ledger``) and keeps the structure: it matches, inserts, splits
and evicts, and tells the ledger when data arrives (:meth:`PoolLedger.put`), goes
(:meth:`~PoolLedger.drop`) or a node is split (:meth:`~PoolLedger.split`). The ledger keeps, per
extra owner pool, the slots it holds (``size``) and the slots a pool lock holds (``protected``),
so neither needs a scan of the tree.

The data lives on the nodes (``node.pool_values[pool]``; ``None`` once dropped) and so do the
locks (``node.pool_locks[pool]``: lock start -> count). A pool lock is recorded by where it
starts on the path (units from the namespace root): a later split then hands the upper half
exactly the locks that reach it, and :meth:`~PoolLedger.unlock` stays exact.

Every method takes any pool name of the model: a sidecar means its owner. Sizes answer for the
anchor too (read from the tree's own counters); data and locks refuse it, since the anchor is
the tree's ``value`` under the tree lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from hicache.errors import InvalidArgumentError
from hicache.radix.node import TreeNode
from hicache.radix.shadow_rules import PoolRoles, lock_start
from hicache.radix.slots import SlotAllocator

__all__ = ["AnchorSizes", "PoolLedger"]


class AnchorSizes(Protocol):
    """The anchor pool's counters: the tree's own (a RadixCache satisfies this)."""

    @property
    def evictable_size(self) -> int: ...

    @property
    def protected_size(self) -> int: ...


class PoolLedger:
    """Per-node data and locks of a tree's extra pools, with exact per-pool counts.

    ``released`` is called on each node a pool lock stops holding, so the tree can queue a
    leaf that just became evictable (its lazy eviction heap would not find it otherwise).
    """

    def __init__(
        self,
        roles: PoolRoles,
        allocators: Mapping[str, SlotAllocator],
        page_size: int,
        anchor: AnchorSizes,
        released: Callable[[TreeNode], None],
    ) -> None:
        self.roles = roles
        self._allocators = {name: allocators[name] for name in roles.extra}
        self._page_size = page_size
        self._anchor = anchor
        self._released = released
        self._held = dict.fromkeys(roles.extra, 0)  # slots on nodes, per extra owner pool
        self._locked = dict.fromkeys(roles.extra, 0)  # of those, slots a pool lock holds

    # ----- sizes ----------------------------------------------------------------------------
    def size(self, pool: str) -> int:
        """Slots of ``pool`` the tree holds (tokens for a per-token pool, snapshots for a
        per-sequence one; a sidecar: its owner's)."""
        owner = self.roles.owner(pool)
        if owner == self.roles.anchor:
            return self._anchor.evictable_size + self._anchor.protected_size
        return self._held[owner]

    def protected(self, pool: str) -> int:
        """Slots of ``pool`` that a lock holds (the anchor: the tree lock; others: a pool lock)."""
        owner = self.roles.owner(pool)
        if owner == self.roles.anchor:
            return self._anchor.protected_size
        return self._locked[owner]

    def evictable(self, pool: str) -> int:
        """Slots of ``pool`` the tree holds that no lock holds."""
        owner = self.roles.owner(pool)
        if owner == self.roles.anchor:
            return self._anchor.evictable_size
        return self._held[owner] - self._locked[owner]

    # ----- per-node queries -----------------------------------------------------------------
    def data(self, node: TreeNode, pool: str) -> torch.Tensor | None:
        """``pool``'s slots on ``node`` (see :mod:`hicache.radix.shadow_rules`), or None."""
        return _data(node, self.roles.extra_owner(pool))

    def lock_ref(self, node: TreeNode, pool: str) -> int:
        """How many locks of ``pool`` hold ``node``."""
        return sum(_locks(node, self.roles.extra_owner(pool)).values())

    @staticmethod
    def holds_any(node: TreeNode) -> bool:
        """Whether ``node`` holds data of any extra pool (on the tree's device)."""
        values = node.pool_values
        return values is not None and any(v is not None for v in values.values())

    @staticmethod
    def is_locked(node: TreeNode) -> bool:
        """Whether any pool lock holds ``node`` (then the tree must not remove it)."""
        locks = node.pool_locks
        return locks is not None and any(locks.values())

    # ----- data -----------------------------------------------------------------------------
    def put(self, node: TreeNode, pool: str, data: torch.Tensor) -> None:
        """Give ``node`` the slots ``data`` of ``pool``; the ledger owns them from now on.
        Raises, changing nothing, if the node holds that pool's data already."""
        name = self.roles.extra_owner(pool)
        if _data(node, name) is not None:
            raise InvalidArgumentError(f"{node!r} already holds data of pool {name!r}")
        if node.pool_values is None:
            node.pool_values = {}
        node.pool_values[name] = data
        self._held[name] += len(data)
        if _locks(node, name):
            self._locked[name] += len(data)

    def drop(self, node: TreeNode, pool: str) -> int:
        """Free ``pool``'s slots on ``node`` to its allocator; returns how many were freed."""
        name = self.roles.extra_owner(pool)
        data = _data(node, name)
        if data is None or not len(data):
            return 0
        amount = len(data)
        self._allocators[name].free(data)
        self._held[name] -= amount
        if _locks(node, name):
            self._locked[name] -= amount
        assert node.pool_values is not None  # _data found data there
        node.pool_values[name] = None
        return amount

    def drop_all(self, node: TreeNode) -> None:
        """Free every extra pool's slots on ``node`` (it is about to leave the tree)."""
        for name in self.roles.extra:
            self.drop(node, name)

    def clear(self, nodes: list[TreeNode]) -> None:
        """Free every extra pool's slots on ``nodes`` and start counting from zero (a reset)."""
        for node in nodes:
            self.drop_all(node)
        self._held = dict.fromkeys(self.roles.extra, 0)
        self._locked = dict.fromkeys(self.roles.extra, 0)

    def split(self, child: TreeNode, upper: TreeNode) -> None:
        """Follow the tree's split of ``child`` into ``upper`` (its first ``upper.length`` units)
        and ``child`` (the rest): per-token data is cut there, a snapshot stays with ``child``
        (it is at its end), and ``upper`` keeps the locks that reach it."""
        self._account(child, -1)
        cut = upper.length
        if child.pool_values:
            upper.pool_values = {}
            for name in self.roles.token_pools:
                data = child.pool_values.get(name)
                if data is not None:
                    upper.pool_values[name], child.pool_values[name] = data[:cut], data[cut:]
        if child.pool_locks:
            upper_end = sum(n.length for n in upper.path_to_root())
            upper.pool_locks = {
                name: {s: c for s, c in locks.items() if s < upper_end}
                for name, locks in child.pool_locks.items()
            }
        self._account(upper, 1)
        self._account(child, 1)

    # ----- locks ----------------------------------------------------------------------------
    def lock(self, node: TreeNode, pool: str, pages: int | None = None) -> None:
        """Keep ``pool``'s data on the nodes of ``node``'s path that it needs from
        ``evict_pool``, and those nodes in the tree: the last ``pages`` pages (default: an SWA
        pool's window, a state pool's end node, every page otherwise). Other pools' data,
        the anchor's included, is not held by it."""
        name, start, targets = self._lock_targets(node, pool, pages)
        for n in targets:
            locks = _locks(n, name, create=True)
            if not locks and _data(n, name) is not None:
                self._locked[name] += _amount(n, name)
            locks[start] = locks.get(start, 0) + 1

    def unlock(self, node: TreeNode, pool: str, pages: int | None = None) -> None:
        """Undo one :meth:`lock` with the same arguments; raises, changing nothing, if that
        lock is not held."""
        name, start, targets = self._lock_targets(node, pool, pages)
        if any(_locks(n, name).get(start, 0) <= 0 for n in targets):
            raise InvalidArgumentError(f"unlock below zero on {node!r} for pool {name!r}")
        for n in targets:
            locks = _locks(n, name)
            locks[start] -= 1
            if not locks[start]:
                del locks[start]
            if not locks and _data(n, name) is not None:
                self._locked[name] -= _amount(n, name)
            self._released(n)

    def _lock_targets(
        self, node: TreeNode, pool: str, pages: int | None
    ) -> tuple[str, int, list[TreeNode]]:
        """(owner pool, where the lock starts, the nodes it holds: nearest first)."""
        name = self.roles.extra_owner(pool)
        if not isinstance(node, TreeNode):
            raise InvalidArgumentError(f"expected a TreeNode, got {type(node).__name__}")
        path = node.path_to_root()
        end = sum(n.length for n in path)
        start = lock_start(self.roles, name, end, self._page_size, pages)
        targets, node_end = [], end
        for n in path:  # a node is held when it ends after ``start``
            if node_end <= start:
                break
            targets.append(n)
            node_end -= n.length
        return name, start, targets

    def _account(self, node: TreeNode, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``node``'s data from the counts."""
        for name in self.roles.extra:
            amount = _amount(node, name) * sign
            self._held[name] += amount
            if _locks(node, name):
                self._locked[name] += amount


# Owner-name accessors for the hot paths: no name resolution, no checks.
def _data(node: TreeNode, name: str) -> torch.Tensor | None:
    return None if node.pool_values is None else node.pool_values.get(name)


def _amount(node: TreeNode, name: str) -> int:
    data = _data(node, name)
    return 0 if data is None else len(data)


def _locks(node: TreeNode, name: str, create: bool = False) -> dict[int, int]:
    if node.pool_locks is None:
        if not create:
            return {}
        node.pool_locks = {}
    if create:
        return node.pool_locks.setdefault(name, {})
    return node.pool_locks.get(name, {})
