"""Which nodes go to L3, and what their acknowledgements change in the tree.

A node is written once it is on host (backed up from the device) and L3 admission lets it in:
every node (``ALL``), or one reused by enough requests (``HIT_THRESHOLD``, checked again on
every hit). What is written is what of the node's host copy L3 lacks: the anchor's pages (with
their sidecars) until the node is ``in_storage``, and each extra pool's host copy (an SWA window's
pages, a state snapshot at the node's last page) until the pool is in ``node.pool_stored``. The
host pages written are protected from host eviction until the write is acknowledged; the writer
counts its own writes in flight per host page (other holders protect pages too).

With ``storage.window_admission`` REUSED (the default), a window pool's pages (SWA) go to L3
only once a request has reused the node (``hit_count``, checked again on every hit): a request
leaves a window at each of its ends, and one whose prefix nobody extends (a question asked once
about a shared document) would otherwise store about as many window bytes as it has tokens of
its own. The price: a prompt revisited only after device and host lost it finds no window in
L3 and is recomputed (ALL stores every window). The anchor's pages and snapshots are written by
the admission policy alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hicache.radix.node import TreeNode
from hicache.tiering.common.config import StorageConfig
from hicache.tiering.common.parts import TierPools
from hicache.tiering.common.policies import admit_to_l3, admit_window
from hicache.tiering.host.pool import host_pools_of
from hicache.tiering.l3.bundler import PageHasher
from hicache.tiering.l3.storage_tier import StorageTier, WriteJob

__all__ = ["L3Writer"]


@dataclass(eq=False, slots=True)
class L3Writer:
    """Submits host copies of nodes to the storage tier and applies its acknowledgements;
    ``hasher`` keys their pages, ``config`` says which go."""

    pools: TierPools
    storage: StorageTier
    hasher: PageHasher
    config: StorageConfig
    # Per owner pool, per host page: writes of it in flight. Protection alone cannot say so:
    # a HiSparse request protects the host pages it decodes from, which L3 may still lack.
    _writing: dict[str, torch.Tensor] = field(default_factory=dict)

    def after_backup(self, node: TreeNode) -> None:
        """``node`` just reached host memory: write it to L3 if admitted."""
        if admit_to_l3(self.config.admission, node.hit_count, self.config.admission_hit_threshold):
            self.submit(node)

    def admit_hits(self, path: Iterable[TreeNode]) -> None:
        """Nodes on host whose hits may now admit them to L3 (hit-threshold admission)."""
        if not self.storage.enabled:
            return
        for node in path:
            if node.host_value is not None and self._unwritten(node):
                self.after_backup(node)

    def _unwritten(self, node: TreeNode) -> dict[str, torch.Tensor]:
        """Per owner pool, the host pages of ``node`` that L3 does not hold yet."""
        out: dict[str, torch.Tensor] = {}
        if not node.in_storage and node.host_value is not None:
            out[self.pools.roles.anchor] = node.host_value
        windows = self.pools.roles.windows  # an ALL_PAGES pool (c128) goes as the anchor does
        admission = self.config.window_admission
        for pool, pages in host_pools_of(node):
            if pool in node.pool_stored:
                continue
            if pool in windows and not admit_window(admission, node.hit_count):
                continue  # under REUSED, a window goes once a request reused it
            out[pool] = pages
        return out

    def submit(self, node: TreeNode) -> None:
        if not self.storage.enabled or node.host_value is None:
            return
        hosts = self.pools.hosts
        plan = {  # what is not on its way to L3 already
            pool: pages
            for pool, pages in self._unwritten(node).items()
            if not bool(self._in_flight(pool)[pages].any())
        }
        if not plan:
            return
        bundle = self.hasher.node_bundle(node, self._per_page(node, plan))
        for pool, pages in plan.items():
            hosts[pool].protect(pages)  # not evicted before the write is acknowledged
            self._in_flight(pool)[pages] += 1
        self.storage.submit_write(WriteJob(bundle, float(node.hit_count), (node, plan)))

    def _in_flight(self, pool: str) -> torch.Tensor:
        counts = self._writing.get(pool)
        if counts is None:
            counts = torch.zeros(self.pools.hosts[pool].num_pages, dtype=torch.int32)
            self._writing[pool] = counts
        return counts

    def _per_page(self, node: TreeNode, plan: dict[str, torch.Tensor]) -> list[dict[str, int]]:
        """Each token page's host page per pool to write (sidecars share their owner's)."""
        groups, roles = self.pools.groups, self.pools.roles
        n_pages = node.length // self.pools.page_size
        per_page: list[dict[str, int]] = [{} for _ in range(n_pages)]
        for owner, pages in plan.items():
            listed = pages.tolist()
            at = [n_pages - 1] if owner in roles.state_pools else range(n_pages)
            for i, host_page in zip(at, listed, strict=True):
                per_page[i].update(dict.fromkeys(groups[owner], host_page))
        return per_page

    def apply_acks(self) -> None:
        """Release the host pages of acknowledged writes; mark what is fully written."""
        acks = self.storage.write_acks
        hosts, anchor = self.pools.hosts, self.pools.roles.anchor
        while acks:
            job = acks.popleft()
            node, plan = job.owner
            for pool, pages in plan.items():
                hosts[pool].release(pages)
                self._in_flight(pool)[pages] -= 1
            if not (job.ok and all(job.ok)):
                continue
            if anchor in plan:
                node.in_storage = True
            node.pool_stored = node.pool_stored | (set(plan) - {anchor})
