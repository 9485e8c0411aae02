"""The engine's side of HiSparse: what a request holds from admission to finish.

* **Admission** (:meth:`HiSparseRequests.admit`): a hot buffer row, indexer slots for its whole
  context (prompt and output) and host pages of its own for what the tree will not hold (the
  prompt's last partial page and the output). The prompt's uncached part still takes anchor
  slots for prefill, which runs as without HiSparse; the request's latent beyond that never
  takes device memory, so admission counts the hot buffer, not the context.
* **After prefill** (:meth:`HiSparseRequests.enter`): the prompt's whole pages are committed to
  the radix tree and copied to host now where they are not there yet (the eager backup; when
  host memory cannot take them yet, held by copies in flight to L3, the request waits a step);
  the request protects those host pages (shared with every other request on the same prefix),
  each as soon as it is on host, before a later node's backup can evict it,
  copies its last partial page to its own host page and its indexer keys to its slots, then
  gives back its anchor slots and its lock: the device copies of its prefix stay in the tree as
  cache, evictable like any other.
* **Decode**: its chunks read the indexer from its slots and the latent through its buffer row.
* **Finish** (:meth:`HiSparseRequests.release`): protections dropped, own host pages and the row
  freed. Its generated tokens are not added to the tree.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from hicache.models.types import ChunkInput
from hicache.radix.node import TreeNode
from hicache.serving.request import RequestState, ServeRequest
from hicache.sparse.hot_buffer import HotBuffer, HotRequest
from hicache.tiering.cache import HiRadixCache

__all__ = ["HiSparseRequests", "HotEntry"]


class HotEntry(enum.Enum):
    """What :meth:`HiSparseRequests.enter` did."""

    ENTERED = "entered"
    HOST_BUSY = "host memory cannot take the prompt's pages now"
    SHORT_PREFIX = "the tree holds fewer of the prompt's pages than admission counted"


class HiSparseRequests:
    """HiSparse for one engine: its hot ``buffer`` over the tiered ``tree``'s host pool."""

    def __init__(self, buffer: HotBuffer, tree: HiRadixCache, pools: dict[str, Any]) -> None:
        self.buffer = buffer
        self.tree = tree
        self._latent = pools["latent"].buffer
        self._indexer = pools["indexer"].buffer
        self.page_size = tree.page_size

    def refusal(self, request: ServeRequest, anchor_tokens: int) -> str | None:
        total = len(request.prompt) + request.max_new_tokens
        capacity = self.buffer.index_slots.size
        host_pages = self.tree.host.num_pages
        if -(-total // self.page_size) > host_pages:
            return (
                f"prompt of {len(request.prompt)} tokens plus {request.max_new_tokens} to "
                f"generate do not fit host memory ({host_pages} pages of {self.page_size} "
                "tokens): HiSparse keeps the whole context on host"
            )
        if total > capacity:
            return (
                f"prompt of {len(request.prompt)} tokens plus {request.max_new_tokens} to "
                f"generate do not fit the HiSparse indexer slots ({capacity} tokens)"
            )
        if len(request.prompt) > anchor_tokens:
            return (
                f"prompt of {len(request.prompt)} tokens does not fit the device pool for its "
                f"prefill ({anchor_tokens} tokens)"
            )
        return None

    def admit(self, request: ServeRequest) -> bool:
        """Take what the request holds while it decodes; whether all of it could be had."""
        ps = self.page_size
        total = len(request.prompt) + request.max_new_tokens
        taken = self.buffer.take_row(total)
        if taken is None:
            return False
        row, index_slots = taken
        own_pages = -(-total // ps) - len(request.prompt) // ps
        own = self.tree.host_evictor.alloc(own_pages)
        if own is None:
            self.buffer.give_back(row, index_slots)
            return False
        request.hot = HotRequest(row, index_slots, own)
        return True

    def enter(self, request: ServeRequest, commit: Any) -> HotEntry:
        """Move a request whose prompt is computed onto the hot buffer (``commit``: the
        engine's commit of its computed pages). ``HOST_BUSY``: host memory could not take the
        prompt's pages now (pages in flight to L3 are held): nothing changed, try again later."""
        hot, cached = request.hot, request.cached
        assert hot is not None and cached is not None
        cached.token_ids = request.all_tokens
        commit(cached, request.pool_state)
        path = list(reversed(cached.last_node.path_to_root())) if cached.last_node else []
        hosted = self._hold_on_host(path)
        if hosted is None:  # all of the path on host, or none of it used
            return HotEntry.HOST_BUSY
        try:
            shared = torch.cat(hosted) if hosted else hot.own_host[:0]
            return self._enter_hosted(request, hot, shared)
        finally:
            for pages in hosted:
                self.tree.host.release(pages)

    def _hold_on_host(self, path: list[TreeNode]) -> list[torch.Tensor] | None:
        """Each node's host pages, each protected from the time it is seen (backing up a later
        node may evict host copies, and a copy the device and L3 also hold is the first to go:
        left unprotected, an earlier node's pages could be freed and given to a later one);
        None, with nothing protected, when a node cannot be had on host now."""
        hosted: list[torch.Tensor] = []
        for node in path:
            if not self._on_host(node) or node.host_value is None:
                for pages in hosted:
                    self.tree.host.release(pages)
                return None
            self.tree.host.protect(node.host_value)
            hosted.append(node.host_value)
        return hosted

    def _enter_hosted(
        self, request: ServeRequest, hot: HotRequest, shared: torch.Tensor
    ) -> HotEntry:
        """:meth:`enter` once the request's path is on host (``shared``: its pages in order)."""
        cached = request.cached
        assert cached is not None
        ps, prompt_len = self.page_size, len(request.prompt)
        if len(shared) + len(hot.own_host) < -(-(prompt_len + request.max_new_tokens) // ps):
            return HotEntry.SHORT_PREFIX
        self.tree.host.protect(shared)
        hot.shared_host = shared
        host_pages = torch.cat([shared, hot.own_host])
        self.buffer.host_table[hot.row, : len(host_pages)] = host_pages
        table = self.tree.req_to_token
        assert table is not None  # the engine gave the tree its table
        row = table.table[cached.req_pool_idx]
        self._copy_tail(hot, row, len(shared) * ps, prompt_len)
        index_slots = hot.index_slots[:prompt_len].to(self._indexer.device)
        self.buffer.index[0, :, index_slots] = self._indexer[0, :, row[:prompt_len]].to(
            self.buffer.index.device
        )
        self.tree.release_request(cached)  # its anchor slots, row and lock
        hot.entered = True
        return HotEntry.ENTERED

    def enter_all(
        self, requests: list[ServeRequest], commit: Any, now: float, stall_s: float
    ) -> list[ServeRequest]:
        """:meth:`enter` each request; the ones that failed: whose prefix the tree lost, or
        that waited ``stall_s`` for host memory (marked failed, holding nothing)."""
        failed = []
        for request in requests:
            hot = request.hot
            assert hot is not None and request.cached is not None
            entry = self.enter(request, commit)
            if entry is HotEntry.ENTERED:
                continue
            if hot.waiting_since is None:
                hot.waiting_since = now
            if entry is HotEntry.HOST_BUSY and now - hot.waiting_since < stall_s:
                continue
            self.tree.release_request(request.cached)
            self.release(request)
            request.state, request.record.error = RequestState.FAILED, f"HiSparse: {entry.value}"
            failed.append(request)
        return failed

    def _on_host(self, node: TreeNode) -> bool:
        """Whether ``node``'s pages are on host once this returns (copied now if need be)."""
        if node.host_value is None:
            return self.tree.backups.backup(node, evicting=True) and node.host_value is not None
        for entry in self.tree.backups.in_flight:
            if entry.node is node:
                entry.transfer.synchronize()
        return True

    def _copy_tail(self, hot: HotRequest, row: torch.Tensor, start: int, end: int) -> None:
        """The prompt's tokens past the tree's pages, into the request's first own page."""
        if end <= start:
            return
        slots = row[start:end].to(self._latent.device)
        data = self._latent[0, :, slots].to("cpu")  # (layers, n, *item)
        host_layers = self.buffer.host_latent  # (page, layer, token, *item)
        host_layers[int(hot.own_host[0]), :, : end - start] = data.to(host_layers.dtype)

    def chunk(self, request: ServeRequest) -> ChunkInput:
        """The next decode token of a request on the hot buffer."""
        hot, cached = request.hot, request.cached
        assert hot is not None and cached is not None
        start = cached.kv_len
        ids = torch.tensor([request.generated[-1]], dtype=torch.int64)
        return ChunkInput(ids, start, hot.index_slots[: start + 1], hot_row=hot.row)

    def release(self, request: ServeRequest) -> None:
        """Give back what the request holds (finished, failed or never entered)."""
        hot = request.hot
        if hot is None:
            return
        if len(hot.shared_host):
            self.tree.host.release(hot.shared_host)
        if len(hot.own_host):
            self.tree.host.free(hot.own_host)
        self.buffer.give_back(hot.row, hot.index_slots)
        request.hot = None
