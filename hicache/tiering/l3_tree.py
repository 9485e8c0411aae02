"""The L3 half of HiRadixCache: page hashes of nodes, writes to L3, prefetches from it.

A node's page hashes continue the chain of its parent (the first page of a namespace is seeded
by the namespace digest), so the keys of a prefix are the same whichever node boundaries the
tree happens to have, in this process or the next one.

Prefetch: ``prefetch_from_storage`` starts reading the page-aligned part of a request after its
device and host hit; ``check_prefetch_progress`` tells the scheduler whether the request may run
(the stop policy decides), and when it stops a prefetch the pages that arrived are inserted as
host nodes at once, while host pages still being read are freed only once their reads finished.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hicache.codec import NO_PARENT
from hicache.keys import RadixKey, chain_packed_hashes, chain_page_hashes, namespace_digest
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.node import TreeNode
from hicache.radix.tree import RadixCache
from hicache.tiering.bundler import BundlePage
from hicache.tiering.policies import TerminationReason, admit_to_l3, can_terminate, prefetch_timeout
from hicache.tiering.storage_tier import PrefetchOp, WriteJob

if TYPE_CHECKING:
    from hicache.pools.host import HostPool
    from hicache.tiering.controller import HiCacheController
    from hicache.tiering.metrics import HiCacheMetrics

__all__ = ["L3TreeBase"]


class L3TreeBase(RadixCache):
    """The part of HiRadixCache that deals with host pages and L3 (see its docstring)."""

    controller: HiCacheController
    host: HostPool
    metrics: HiCacheMetrics
    _anchors: Counter[int]

    # ----- host pages -----------------------------------------------------------------------
    def _alloc_host(self, n_pages: int) -> torch.Tensor | None:
        pages = self.host.alloc(n_pages)
        if pages is None:
            self.evict_host(n_pages * self.page_size)
            pages = self.host.alloc(n_pages)
        return pages

    def evict_host(self, num_tokens: int) -> int:
        raise NotImplementedError

    def _host_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages.to(torch.int64)[:, None] * self.page_size + offsets).reshape(-1)

    def host_pages(self, node: TreeNode) -> torch.Tensor:
        """The host pages of a backed-up node, in order."""
        pages: torch.Tensor = node.host_value[:: self.page_size] // self.page_size
        return pages

    def _init_l3(self) -> None:
        self.storage = self.controller.storage
        self.prefetch_config = self.controller.config.prefetch
        self.storage_config = self.controller.config.storage
        self._namespaces: dict[tuple[str | None, bool], bytes] = {}
        self._prefetches: dict[str, PrefetchOp] = {}
        self._prefetch_pages = 0  # host pages held by prefetches not yet settled
        self.prefetched_tokens: dict[str, int] = {}  # rid -> tokens its prefetch inserted
        self._pool_names = list(self.controller.host_pools)

    # ----- hashes ---------------------------------------------------------------------------
    def namespace_seed(self, namespace: tuple[str | None, bool]) -> bytes:
        seed = self._namespaces.get(namespace)
        if seed is None:
            seed = namespace_digest(self.storage_config.model_id, *namespace)
            self._namespaces[namespace] = seed
        return seed

    def node_hashes(self, node: TreeNode) -> list[bytes]:
        """The chained page hashes of ``node`` (computed once, kept through splits)."""
        missing: list[TreeNode] = []
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None and walk.hash_value is None:
            missing.append(walk)
            walk = walk.parent
        for n in reversed(missing):
            parent = n.parent
            assert parent is not None
            seed = self._last_hash(parent, n.namespace)
            page_bytes = self.page_size * (8 if n.namespace[1] else 4)
            n.hash_value = chain_packed_hashes(n.key, page_bytes, seed)
        assert node.hash_value is not None
        return node.hash_value

    def _last_hash(self, node: TreeNode, namespace: tuple[str | None, bool]) -> bytes:
        if node.parent is None:
            return self.namespace_seed(namespace)
        return self.node_hashes(node)[-1]

    @staticmethod
    def _offset(node: TreeNode) -> int:
        units, walk = 0, node.parent
        while walk is not None:
            units += walk.length
            walk = walk.parent
        return units

    # ----- writes to L3 ---------------------------------------------------------------------
    def _after_backup(self, node: TreeNode) -> None:
        """A node just reached host memory: write it to L3 if admitted."""
        cfg = self.storage_config
        if admit_to_l3(cfg.admission, node.hit_count, cfg.admission_hit_threshold):
            self._submit_l3(node)

    def _admit_path(self, path: list[TreeNode]) -> None:
        """Nodes on host whose hits now admit them to L3 (hit-threshold admission)."""
        if not self.storage.enabled:
            return
        for node in path:
            if node.host_value is not None and not node.in_storage:
                self._after_backup(node)

    def _submit_l3(self, node: TreeNode) -> None:
        if not self.storage.enabled or node.in_storage or node.host_value is None:
            return
        pages = self.host_pages(node)
        if bool(self.host.is_protected(pages).any()):
            return  # a write of these pages is already on its way
        hashes = self.node_hashes(node)
        parent = node.parent
        assert parent is not None
        first = self._offset(node) // self.page_size
        prev = self._last_hash(parent, node.namespace) if first else NO_PARENT
        seed = self.namespace_seed(node.namespace)
        bundle = []
        for i, (page, page_hash) in enumerate(zip(pages.tolist(), hashes, strict=True)):
            parent_hash = hashes[i - 1] if i else prev
            host_pages = dict.fromkeys(self._pool_names, page)
            bundle.append(BundlePage(seed, page_hash, host_pages, first + i, parent_hash))
        self.host.protect(pages)
        self.storage.submit_write(WriteJob(bundle, float(node.hit_count), (node, pages)))

    def _drain_l3(self) -> None:
        acks = self.storage.write_acks
        while acks:
            job = acks.popleft()
            node, pages = job.owner
            self.host.release(pages)
            if job.ok and all(job.ok):
                node.in_storage = True
        finished = self.storage.finished_prefetches
        while finished:
            op = finished.popleft()
            if op.taken_pages is None:
                self._take(op, op.reason or TerminationReason.COMPLETE)
            self._free_tail(op)

    # ----- prefetch -------------------------------------------------------------------------
    def prefetch_from_storage(self, rid: str, key: RadixKey, match: Any) -> bool:
        """Start reading from L3 the page-aligned part of ``key`` after ``match``'s hits.

        Only when L3 is on, at least ``threshold_tokens`` are asked for and the request has no
        prefetch yet. ``match`` is this key's :meth:`match_prefix` result.
        """
        if not self.storage.enabled or not self.prefetch_config.enabled or rid in self._prefetches:
            return False
        start = match.prefix_len + match.host_hit_length
        end = len(key) - len(key) % self.page_size
        if end - start < self.prefetch_config.threshold_tokens:
            self.metrics.add("prefetch_skipped_small")
            return False
        last: TreeNode = match.last_host_node or match.last_device_node
        namespace = (key.extra_key, key.is_bigram)
        seed = self._last_hash(last, namespace)
        hashes = chain_page_hashes(key.slice(start, end), self.page_size, seed)
        ns_seed = self.namespace_seed(namespace)
        first = start // self.page_size
        parents = [seed if first else NO_PARENT, *hashes[:-1]]
        candidates = [
            BundlePage(ns_seed, h, dict.fromkeys(self._pool_names, -1), first + i, parent)
            for i, (h, parent) in enumerate(zip(hashes, parents, strict=True))
        ]
        alloc = self._prefetch_allocator()
        op = PrefetchOp(rid, candidates, alloc, self._clock(), (last, key, start))
        self._anchors[last.id] += 1
        self._prefetches[rid] = op
        self.storage.start_prefetch(op)
        return True

    def _prefetch_allocator(self) -> Callable[[int], list[int] | None]:
        def alloc(n_pages: int) -> list[int] | None:
            limit = int(self.prefetch_config.capacity_share * self.host.num_pages)
            room = limit - self._prefetch_pages
            if room < n_pages:
                self.metrics.add("prefetch_skipped_capacity")
                n_pages = max(room, 0)
            if n_pages == 0:
                return None
            pages = self._alloc_host(n_pages)
            if pages is None:
                n_pages = min(n_pages, self.host.available_pages)
                pages = self.host.alloc(n_pages) if n_pages else None
            if pages is None:
                return None
            self._prefetch_pages += len(pages)
            return [int(p) for p in pages.tolist()]

        return alloc

    def check_prefetch_progress(self, rid: str) -> bool:
        """Whether request ``rid`` may be scheduled now; stops its prefetch when it may."""
        op = self._prefetches.get(rid)
        if op is None or op.taken_pages is not None:
            return True
        tokens = (op.hit_pages or 0) * self.page_size
        cfg = self.prefetch_config
        timeout = prefetch_timeout(
            cfg.timeout_base_s, cfg.timeout_per_1k_tokens_s, cfg.timeout_max_s, tokens
        )
        elapsed = self._clock() - op.start_s
        # A failed call (an error, or one past its deadline that is still running) ends the
        # wait: nothing more will arrive, whatever the policy.
        finished = op.reads_finished or op.reason is not None
        reason = can_terminate(cfg.stop_policy, finished, elapsed, timeout)
        if reason is None:
            return False
        self._stop(op, (op.reason or reason) if finished else reason)
        return True

    def terminate_prefetch(
        self, rid: str, reason: TerminationReason = TerminationReason.ABORTED
    ) -> None:
        """Stop ``rid``'s prefetch now, keeping what has arrived."""
        op = self._prefetches.get(rid)
        if op is not None and op.taken_pages is None:
            self._stop(op, reason)

    def _stop(self, op: PrefetchOp, reason: TerminationReason) -> None:
        op.stop_requested = True
        self._take(op, reason)
        if op.reads_finished:
            self._free_tail(op)

    def _take(self, op: PrefetchOp, reason: TerminationReason) -> None:
        """Insert the pages that arrived; the rest waits for its reads (``_free_tail``)."""
        taken = op.completed_pages
        op.taken_pages = taken
        op.reason = reason
        last, key, start = op.owner
        self._anchors[last.id] -= 1
        if self._anchors[last.id] <= 0:
            del self._anchors[last.id]
        inserted = 0
        if taken:
            inserted = self._insert_host(key, start, op.host_pages[:taken], op.candidates[:taken])
        self._prefetch_pages -= taken
        self.metrics.add("l3_hit_tokens", inserted * self.page_size)
        self.prefetched_tokens[op.rid] = inserted * self.page_size
        self.metrics.add("l3_miss_tokens", (len(op.candidates) - taken) * self.page_size)
        self.metrics.add(f"prefetch_{reason.value}")

    def _free_tail(self, op: PrefetchOp) -> None:
        if op.taken_pages is None or self._prefetches.get(op.rid) is not op:
            return
        tail = op.host_pages[op.taken_pages :]
        if tail:
            self.host.free(torch.tensor(tail, dtype=torch.int64))
        self._prefetch_pages -= len(tail)
        del self._prefetches[op.rid]

    def _insert_host(
        self, key: RadixKey, start: int, pages: list[int], candidates: list[BundlePage]
    ) -> int:
        """Hang prefetched pages under the tree as host-only nodes; free any duplicates.

        Returns how many pages were inserted (the rest was there already, or had no parent).
        """
        end = start + len(pages) * self.page_size
        data, unit = self._pack(key.slice(0, end))
        namespace = (key.extra_key, key.is_bigram)
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._make_root(key)
        node, pos, _ = self._walk(root, data, unit, hit=False)
        have = pos // unit
        if have < start:  # the prefix it continued is gone: nothing to hang the pages from
            self.host.free(torch.tensor(pages, dtype=torch.int64))
            return 0
        dup = (have - start) // self.page_size
        if dup:
            self.host.free(torch.tensor(pages[:dup], dtype=torch.int64))
        if pos == len(data):
            return 0
        leaf = self._new_node(node, data[pos:], unit, *namespace)
        leaf.host_value = self._host_slots(torch.tensor(pages[dup:], dtype=torch.int64))
        leaf.hash_value = [c.page_hash for c in candidates[dup:]]
        leaf.in_storage = True
        return len(pages) - dup

    def release_request(self, req: CachedRequest) -> None:
        """An aborted request: stop its prefetch, free its own slots and row, drop its lock."""
        self.terminate_prefetch(req.rid, TerminationReason.ABORTED)
        if self.req_to_token is not None and req.allocated:
            row = self.req_to_token.table[req.req_pool_idx]
            own = row[len(req.prefix_indices) : req.allocated].clone()
            if len(own):
                self.allocator.free(own)
            self.req_to_token.free(req.req_pool_idx)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = None
        req.allocated = 0

    @property
    def prefetch_pages_in_use(self) -> int:
        return self._prefetch_pages
