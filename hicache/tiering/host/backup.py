"""Device-to-host copies of a tiered tree's nodes, every pool, and the copies in flight.

A backup brings a node's host copy up to date with its device data: the anchor pool's pages
first (``node.host_value``), then each extra pool whose device data the host lacks (an SWA
window, a state snapshot). An extra pool is copied only once the anchor is on host, so what is
on host stays a tree. Outside eviction the copy runs on the transfer stream while the node is
locked (the tree lock for the anchor, a pool lock per extra pool); an evicted node is copied
synchronously, since its device slots are freed right after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.radix.node import TreeNode
from hicache.tiering.common.parts import (
    BackupListener,
    GroupTransfer,
    HostCopies,
    HostPages,
    NodeLocks,
    TierPools,
)
from hicache.tiering.host.pool import host_of, set_host

__all__ = ["Backups"]


@dataclass(slots=True)
class _InFlight:
    transfer: GroupTransfer
    node: TreeNode
    pool_locks: list[tuple[str, int | None]]  # (extra pool, lock pages) held for the copy


@dataclass(eq=False, slots=True)
class Backups:
    """Starts backups of one tiered tree's nodes and settles them (:meth:`settle`).

    ``copies`` runs the copies, ``host`` gives the host pages, ``listener`` hears of every
    node that reached host; with ``host_enabled`` False no anchor is copied to host.
    """

    tree: NodeLocks
    pools: TierPools
    copies: HostCopies
    host: HostPages
    listener: BackupListener
    host_enabled: bool
    in_flight: list[_InFlight] = field(default_factory=list)

    def backup(self, node: TreeNode, evicting: bool = False) -> bool:
        """Copy what of ``node`` the host lacks; whether its anchor is on host (or on its way).

        Outside eviction a node's anchor is backed up only after its parent's, so what is on
        host is a prefix of the tree.
        """
        tree, roles, page_size = self.tree, self.pools.roles, self.pools.page_size
        parts: list[GroupTransfer] = []
        if node.host_value is None:
            pages = self._anchor_pages(node, evicting)
            if pages is None:
                return False
            assert node.value is not None  # _anchor_pages
            node.host_value = pages
            parts.append(self.copies.write(node.value, pages))
        locks: list[tuple[str, int | None]] = []
        for pool in roles.extra:
            data = tree.ledger.data(node, pool)
            if data is None or host_of(node, pool) is not None:
                continue
            token_pool = pool in roles.token_pools
            count = len(data) // page_size if token_pool else len(data)
            held = node.length // page_size if token_pool else None
            # Making room evicts host leaves: the lock keeps this node (and its data) meanwhile.
            tree.ledger.lock(node, pool, held)
            try:
                pages = self.host.alloc_pool(pool, count)
            finally:
                tree.ledger.unlock(node, pool, held)
            if pages is None:
                continue  # on the device only: a later backup tries again
            set_host(node, pool, pages)
            parts.append(self.copies.write(data, pages, owner=pool))
            locks.append((pool, held))
        if not parts:
            return True
        transfer = GroupTransfer.merged(parts)
        if evicting:
            transfer.synchronize()
            self.listener.after_backup(node)
            return True
        tree.inc_lock_ref(node)  # the device slots are read until the copy is done
        for pool, pages_locked in locks:
            tree.ledger.lock(node, pool, pages_locked)
        self.in_flight.append(_InFlight(transfer, node, locks))
        return True

    def _anchor_pages(self, node: TreeNode, evicting: bool) -> torch.Tensor | None:
        parent = node.parent
        if node.value is None or parent is None or not self.host_enabled:
            return None
        if not evicting and parent.parent is not None and parent.host_value is None:
            return None
        return self.host.alloc(node.length // self.pools.page_size)

    def settle(self) -> None:
        """Release the locks of finished copies and offer their nodes to L3."""
        tree, still = self.tree, []
        for entry in self.in_flight:
            if not entry.transfer.done():
                still.append(entry)
                continue
            tree.dec_lock_ref(entry.node)
            for pool, pages in entry.pool_locks:
                tree.ledger.unlock(entry.node, pool, pages)
            self.listener.after_backup(entry.node)
        self.in_flight = still
