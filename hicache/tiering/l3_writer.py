"""Which nodes go to L3, and what their acknowledgements change in the tree.

A node is written once it is on host (backed up from the device) and L3 admission lets it in:
every node (``ALL``), or one reused by enough requests (``HIT_THRESHOLD``, checked again on
every hit). Its host pages are protected from host eviction until the write is acknowledged;
an acknowledged, fully written node is marked ``in_storage``.
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache.pools.host import HostPool
from hicache.radix.node import TreeNode
from hicache.tiering.bundler import PageHasher
from hicache.tiering.config import StorageConfig
from hicache.tiering.policies import admit_to_l3
from hicache.tiering.storage_tier import StorageTier, WriteJob

__all__ = ["L3Writer"]


class L3Writer:
    """Submits host copies of nodes to the storage tier and applies its acknowledgements."""

    def __init__(
        self, storage: StorageTier, host: HostPool, hasher: PageHasher, config: StorageConfig
    ) -> None:
        self.storage = storage
        self.host = host
        self.hasher = hasher
        self.config = config

    def after_backup(self, node: TreeNode) -> None:
        """``node`` just reached host memory: write it to L3 if admitted."""
        if admit_to_l3(self.config.admission, node.hit_count, self.config.admission_hit_threshold):
            self.submit(node)

    def admit_hits(self, path: Iterable[TreeNode]) -> None:
        """Nodes on host whose hits may now admit them to L3 (hit-threshold admission)."""
        if not self.storage.enabled:
            return
        for node in path:
            if node.host_value is not None and not node.in_storage:
                self.after_backup(node)

    def submit(self, node: TreeNode) -> None:
        if not self.storage.enabled or node.in_storage or node.host_value is None:
            return
        pages = node.host_value
        if bool(self.host.is_protected(pages).any()):
            return  # a write of these pages is already on its way
        bundle = self.hasher.node_bundle(node, pages.tolist())
        self.host.protect(pages)
        self.storage.submit_write(WriteJob(bundle, float(node.hit_count), (node, pages)))

    def apply_acks(self) -> None:
        """Release the host pages of acknowledged writes; mark fully written nodes."""
        acks = self.storage.write_acks
        while acks:
            job = acks.popleft()
            node, pages = job.owner
            self.host.release(pages)
            if job.ok and all(job.ok):
                node.in_storage = True
