"""What the parts of the tiered cache receive: the pools they share, and narrow views of the rest.

:class:`~hicache.tiering.cache.HiRadixCache` builds its parts (backups, host eviction, load-back,
prefetch insert, the L3 writer, the prefetcher) and is the only module that knows them all. Each
part gets plain collaborators (the :class:`TierPools`, the metrics, the storage tier, a config)
and, of the tree, the controller and its sibling parts, only a Protocol below that names what it
calls:

========================  =====================================================================
part                      receives
========================  =====================================================================
``Backups``               :class:`NodeLocks`, :class:`TierPools`, :class:`HostCopies`,
                          :class:`HostPages`, :class:`BackupListener`, whether host is on
``HostEvictor``           :class:`NodeIndex`, :class:`TierPools`, the metrics
``LoadBack``              :class:`DeviceRoom`, :class:`TierPools`, :class:`HostCopies`, the
                          host anchors (node id -> holds), the metrics, the load-back threshold
``PrefetchInserter``      :class:`NodeGrafts`, :class:`TierPools`
``L3Writer``              :class:`TierPools`, the storage tier, the page hasher, its config
``Prefetcher``            the ``PrefetchInserter``, the ``HostEvictor`` (its pages, anchors and
                          pools), the storage tier, the page hasher, its config, a clock
========================  =====================================================================

The tree satisfies :class:`NodeLocks`, :class:`NodeIndex`, :class:`DeviceRoom` and
:class:`NodeGrafts` with public operations of its own (no part calls a private step of the tree);
the controller satisfies :class:`HostCopies`, the host evictor :class:`HostPages`, the L3 writer
:class:`BackupListener`. :class:`GroupTransfer` is one device <-> host copy, as the controller
starts it and the host parts wait on it; :class:`HeldPage` is a page as freeing it sees it (an
L3 bundle page), so these views import neither tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hicache.keys import RadixKey
from hicache.layouts import LayerTransfer
from hicache.pools.host import HostPool
from hicache.radix.eviction import SortKey
from hicache.radix.node import TreeNode
from hicache.radix.pool_ledger import PoolLedger
from hicache.radix.shadow_rules import PoolRoles
from hicache.radix.slots import SlotAllocator

__all__ = [
    "BackupListener",
    "DeviceRoom",
    "GroupTransfer",
    "HeldPage",
    "HostCopies",
    "HostPages",
    "NodeGrafts",
    "NodeIndex",
    "NodeLocks",
    "TierPools",
]


class GroupTransfer:
    """One copy of a page set across every pool of the group; per-pool, per-layer events."""

    def __init__(self, transfers: Mapping[str, LayerTransfer]) -> None:
        self.transfers = dict(transfers)

    @classmethod
    def merged(cls, parts: list[GroupTransfer]) -> GroupTransfer:
        """One transfer over several groups' (each pool is in one group only)."""
        return cls({name: t for part in parts for name, t in part.transfers.items()})

    def wait_layer(self, pool: str, layer: int) -> None:
        """Make the current stream wait until ``layer`` of ``pool`` is copied (no host block);
        nothing to wait for when this transfer does not copy ``pool``."""
        transfer = self.transfers.get(pool)
        if transfer is not None:
            transfer.wait_layer(layer)

    def done(self) -> bool:
        return all(t.done() for t in self.transfers.values())

    def synchronize(self) -> None:
        for transfer in self.transfers.values():
            transfer.synchronize()


class HeldPage(Protocol):
    """A page as freeing it sees it: its host page per pool (an L3 bundle page)."""

    @property
    def host_pages(self) -> Mapping[str, int]: ...


@dataclass(frozen=True, slots=True)
class TierPools:
    """The pools of one tiered cache as its parts see them.

    ``groups``: per owner pool, the pools its slots address (itself first), which move together;
    ``hosts``: per owner pool, its host pool (a sidecar's pages are its owner's).
    """

    roles: PoolRoles
    page_size: int
    groups: Mapping[str, Sequence[str]]
    hosts: Mapping[str, HostPool]

    def free_pages(self, pages: Iterable[HeldPage]) -> None:
        """Free every owner pool's host page of ``pages`` (sidecars share their owner's)."""
        owned: dict[str, list[int]] = {}
        for page in pages:
            for name, host_page in page.host_pages.items():
                if name in self.groups and host_page >= 0:
                    owned.setdefault(name, []).append(host_page)
        for name, host_pages in owned.items():
            self.hosts[name].free(torch.tensor(host_pages, dtype=torch.int64))


class NodeLocks(Protocol):
    """What keeps a node's data in place while a copy reads it: the tree lock (the anchor's
    slots) and the ledger's pool locks (each extra pool's data, which the ledger also holds)."""

    @property
    def ledger(self) -> PoolLedger: ...
    def inc_lock_ref(self, node: TreeNode) -> None: ...
    def dec_lock_ref(self, node: TreeNode) -> None: ...


class NodeIndex(Protocol):
    """The tree as host eviction walks it: every node, the eviction order, the extra pools'
    device data (the ledger), and taking a leaf out."""

    @property
    def ledger(self) -> PoolLedger: ...
    @property
    def eviction_order(self) -> Callable[[TreeNode], SortKey]: ...
    def all_nodes(self) -> list[TreeNode]: ...
    def detach_leaf(self, node: TreeNode) -> None: ...


class DeviceRoom(NodeLocks, Protocol):
    """The tree's device side for a load-back: each pool's slot allocator, eviction to make
    room, and host-only nodes given device slots again."""

    @property
    def allocators(self) -> Mapping[str, SlotAllocator]: ...
    def evict(self, num_tokens: int) -> int: ...
    def evict_pool(self, pool: str, num_slots: int) -> int: ...
    def restore_device_slots(self, node: TreeNode, slots: torch.Tensor) -> None: ...
    def requeue(self, node: TreeNode) -> None: ...


class NodeGrafts(Protocol):
    """The tree's steps that hang pages arriving from L3 under a cached prefix."""

    def hang_leaf(self, key: RadixKey, after: int) -> tuple[TreeNode, int, TreeNode | None]: ...
    def split_node(self, node: TreeNode, units: int) -> TreeNode: ...


class HostCopies(Protocol):
    """Device <-> host copies of one pool group (the controller's)."""

    def write(
        self, device_slots: torch.Tensor, host_pages: torch.Tensor, owner: str | None = None
    ) -> GroupTransfer: ...
    def load(
        self, host_pages: torch.Tensor, device_slots: torch.Tensor, owner: str | None = None
    ) -> GroupTransfer: ...


class HostPages(Protocol):
    """Host pages that evict host-only leaves to make room (the host evictor's)."""

    def alloc(self, n_pages: int) -> torch.Tensor | None: ...
    def alloc_pool(self, pool: str, count: int) -> torch.Tensor | None: ...


class BackupListener(Protocol):
    """Told of each node whose backup reached host memory (the L3 writer)."""

    def after_backup(self, node: TreeNode) -> None: ...
