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
* **Finish** (:meth:`HiSparseRequests.release`): the whole pages it computed past its committed
  prompt (the prompt's last partial page and its output, up to the last whole page) are hung
  under its prompt's node as host-only nodes, as ``cache_finished_req`` caches a request's
  output without HiSparse: their latent is on host already (written eagerly each step), their
  indexer keys are copied from its indexer slots to the indexer's host pages, and the nodes go
  to L3 as any backup does. A follow-up turn that extends the conversation hits them on host.
  Then protections are dropped and its other own host pages and the row freed.

On ``dsv4`` the hot buffer holds C4 entries (the anchor's pages: a quarter entry a token) and
the indexer keys are C4's; the request's window (``swa``) and C128 slots stay on the device as
without HiSparse (:class:`~hicache.serving.pool_slots.PoolSlots`): entering commits them with
the prompt and keeps their locks, each decode chunk takes their slots (:meth:`chunk`), and
release frees them. At finish its new nodes get host copies of its C128 entries and of its last
window (a node of their own), copied from those slots before they are freed, so a follow-up
turn hits its output as on DSA.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from hicache.models.types import ChunkInput
from hicache.radix.node import TreeNode
from hicache.serving.pool_slots import PoolSlots
from hicache.serving.request import RequestState, ServeRequest
from hicache.sparse.hot_buffer import HotBuffer, HotRequest, canonical_pages
from hicache.tiering.contract import ComputedHostPages, TieredCache

__all__ = ["HiSparseRequests", "HotEntry"]

_Extras = dict[str, tuple[int, torch.Tensor]]  # per extra pool: (first position, host pages)


class HotEntry(enum.Enum):
    """What :meth:`HiSparseRequests.enter` did."""

    ENTERED = "entered"
    HOST_BUSY = "host memory cannot take the prompt's pages now"
    SHORT_PREFIX = "the tree holds fewer of the prompt's pages than admission counted"


class HiSparseRequests:
    """HiSparse for one engine: its hot ``buffer`` over the tiered ``tree``'s host pool."""

    def __init__(
        self, buffer: HotBuffer, tree: TieredCache, pools: dict[str, Any], slots: PoolSlots
    ) -> None:
        self.buffer = buffer
        self.tree = tree
        self.pool_slots = slots
        self._latent = pools[tree.roles.anchor].buffer
        self._indexer = pools["indexer"].buffer
        self._host_index = canonical_pages(tree.host_pools["indexer"])[:, 0]
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
        return self.pool_slots.refusal(request)

    def admit(self, request: ServeRequest) -> bool:
        """Take what the request holds while it decodes; whether all of it could be had."""
        ps = self.page_size
        total = len(request.prompt) + request.max_new_tokens
        taken = self.buffer.take_row(total)
        if taken is None:
            return False
        row, index_slots = taken
        own_pages = -(-total // ps) - len(request.prompt) // ps
        own = self.tree.alloc_host_pages(own_pages)
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
        self.buffer.set_host_pages(hot.row, torch.cat([shared, hot.own_host]))
        table = self.tree.req_to_token
        assert table is not None  # the engine gave the tree its table
        row = table.table[cached.req_pool_idx]
        self._copy_tail(hot, row, len(shared) * ps, prompt_len)
        index_slots = hot.index_slots[:prompt_len].to(self._indexer.device)
        self.buffer.index[0, :, index_slots] = self._indexer[0, :, row[:prompt_len]].to(
            self.buffer.index.device
        )
        self.tree.release_request(cached)  # its anchor slots, row and lock
        if request.pool_state is not None:  # its other pools stay; it commits no more of them
            request.pool_state.keep_points = []
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
            if entry is HotEntry.HOST_BUSY and self.tree.prefetch_yield_reserved():
                # host memory that queued requests' prefetches kept may go to a running one
                entry = self.enter(request, commit)
            if entry is HotEntry.ENTERED:
                continue
            if hot.waiting_since is None:
                hot.waiting_since = now
            if entry is HotEntry.HOST_BUSY and now - hot.waiting_since < stall_s:
                continue
            self.tree.release_request(request.cached)
            if request.pool_state is not None:
                self.pool_slots.release(request.pool_state)
            self.release(request)
            request.state, request.record.error = RequestState.FAILED, f"HiSparse: {entry.value}"
            failed.append(request)
        return failed

    def _on_host(self, node: TreeNode) -> bool:
        """Whether ``node``'s pages are on host once this returns (copied now if need be)."""
        return self.tree.backup_now(node)

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
        if int(self.buffer.host_table[hot.row, start // self.page_size]) < 0:
            raise RuntimeError("a HiSparse request would write past the host pages it holds")
        ids = torch.tensor([request.generated[-1]], dtype=torch.int64)
        chunk = ChunkInput(ids, start, hot.index_slots[: start + 1], hot_row=hot.row)
        self.pool_slots.fill(request.pool_state, chunk)  # dsv4: its window's and C128's slots
        return chunk

    def release(self, request: ServeRequest) -> None:
        """Give back what the request holds (finished, failed or never entered); a request
        that decoded from the buffer first leaves its computed pages in the tree."""
        hot = request.hot
        if hot is None:
            return
        if hot.entered:
            self.cache_computed(request)
            if request.pool_state is not None:
                self.pool_slots.release(request.pool_state)
        if len(hot.shared_host):
            self.tree.host.release(hot.shared_host)
        if len(hot.own_host):
            self.tree.host.free(hot.own_host)
        self.buffer.give_back(hot.row, hot.index_slots)
        request.hot = None

    def cache_computed(self, request: ServeRequest) -> int:
        """Hang the whole pages ``request`` computed past the tree's part of its path under
        that path, on host only; how many pages the tree took (fewer when another request
        cached some of them meanwhile). The pages taken leave ``hot.own_host``. On dsv4 the
        new nodes also get host copies of the request's C128 entries (every page) and window
        (the last window's pages, on a node of their own), so that their end is a usable
        prefix; when host memory cannot take those, nothing is hung."""
        hot, cached = request.hot, request.cached
        assert hot is not None and cached is not None
        ps, start = self.page_size, len(hot.shared_host)
        cached.token_ids = request.all_tokens
        key = cached.key(ps)  # the computed tokens' whole pages
        count = len(key) // ps - start
        if count <= 0:
            return 0
        self.buffer.drain()  # every eager host write of its latent has landed
        extras = self._extras_to_host(request, start * ps, len(key))
        if extras is None:
            return 0
        own = hot.own_host[:count]
        self._copy_index_keys(hot, start * ps, own)
        # the tree takes the last ``taken`` of ``own`` (it held the others) and every extra page
        computed = ComputedHostPages(key, start * ps, own, extras, cached.priority)
        taken = self.tree.insert_host_pages(computed)
        if not taken:  # all there already (or, never here, its prefix gone)
            return 0
        kept = torch.ones(len(hot.own_host), dtype=torch.bool)
        kept[count - taken : count] = False
        hot.own_host = hot.own_host[kept]
        return taken

    def _extras_to_host(self, request: ServeRequest, lo: int, hi: int) -> _Extras | None:
        """dsv4: copies on host of the request's extra pools over positions ``lo .. hi - 1``
        (a window pool: its last window of them), per pool (first position, host pages);
        None, with nothing held, when one cannot be had (a slot already trimmed, no host
        room). Empty for a model without extra pools."""
        state = request.pool_state
        out: _Extras = {}
        if not self.pool_slots.active or state is None:
            return {}
        for name, window in self.pool_slots.windows.items():
            first = lo if window is None else max(lo, hi - window)
            slots = state.rows[name][first:hi]
            pages = None
            if not bool((slots < 0).any()):
                pages = self.tree.alloc_pool_host_pages(name, (hi - first) // self.page_size)
            if pages is None:
                self._free_extras(out)
                return None
            # slots on the CPU, as every backup passes them: the copy plan checks them there
            self.tree.copy_to_host(slots, pages, owner=name).synchronize()
            out[name] = (first, pages)
        return out

    def _free_extras(self, extras: _Extras) -> None:
        hosts = self.tree.host_pools
        for name, (_, pages) in extras.items():
            hosts[name].free(pages)

    def _copy_index_keys(self, hot: HotRequest, start: int, pages: torch.Tensor) -> None:
        """The indexer keys of positions ``start ..`` (whole ``pages``) from the request's
        indexer slots into those host pages of the indexer's host pool."""
        ps, count = self.page_size, len(pages)
        slots = hot.index_slots[start : start + count * ps].to(self.buffer.index.device)
        keys = self.buffer.index[0, :, slots]  # (layers, count * ps, item)
        keys = keys.view(keys.shape[0], count, ps, -1).transpose(0, 1).to("cpu")
        self._host_index[pages] = keys.to(self._host_index.dtype)

    def close(self) -> None:
        """Stop the buffer's copier (every request released first)."""
        self.buffer.close()
