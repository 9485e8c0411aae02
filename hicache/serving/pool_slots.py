"""The engine's side of the extra pools: what each running request holds in them, from admission
to finish (the tree's side is :mod:`hicache.radix.pool_lifecycle`).

* **Token pools** (SWA, window ``W`` tokens): a request's slots are allocated per chunk and the
  pages that left its window are freed after each chunk (:func:`~hicache.radix.pool_lifecycle.
  trim_windows`). So that a running request never fails for memory, admission reserves the most
  it will ever hold (:meth:`PoolSlots.reserve`): its own slots, at most ``W`` plus the chunk's
  pages plus one page, and with a tree the tree's slots its window lock can pin, at most
  ``2W - page_size`` (nodes holding window data are at most ``W`` long, since a commit gives the
  tree only the window before the key's end). A request is admitted only while the
  reservations of the running ones fit the pool; a chunk then takes slots, evicting unlocked
  tree data (``evict_pool``) when the pool is short, which always suffices. A token pool under
  an ALL_PAGES rule (dsv4's ``c128``) has no window: a request keeps every position's slot and
  reserves its whole length (:func:`whole_reserve`; the tree's slots its lock pins are of
  positions it does not hold slots of its own for).
* **State pools** (conv, with ssm on the same slots): at admission a request takes one working
  slot and a slot for each snapshot it will take (``evict_pool`` when short, or it waits): at
  every multiple of ``state_interval`` after its cached prefix, at the page-aligned end of its
  reusable prompt (``len(prompt) - 1``) and at the page-aligned end of what it will have
  computed when it finishes (``len(prompt) + max_new_tokens - 1`` tokens). A prefix hit's
  snapshot stays pool-locked until the first chunk has read it (``ChunkInput.state_from``: the
  model reads it per layer, after any load into it, and leaves the state in the working slot).
  Without a tree only the working slot is taken.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hicache.errors import ConfigError
from hicache.models.config import ModelConfig
from hicache.models.types import ChunkInput
from hicache.pools.device import DevicePool
from hicache.pools.pool_spec import HitRuleKind
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.node import TreeNode
from hicache.radix.pool_lifecycle import (
    PoolRequest,
    cache_finished_bundle,
    cache_unfinished_bundle,
    lock_windows,
    path_slots,
    trim_windows,
    unlock_windows,
)
from hicache.radix.shadow_rules import pool_roles
from hicache.radix.tree import RadixCache
from hicache.serving.request import ServeRequest

__all__ = ["PoolSlots", "swa_reserve", "whole_reserve"]


def swa_reserve(window: int, chunk: int, page_size: int, tree: bool) -> int:
    """The most slots of a window pool one request holds at once: its own (the window and a
    chunk, rounded out to pages) and, with a tree, the tree's slots its window lock pins."""
    own = window + (math.ceil(chunk / page_size) + 1) * page_size
    return own + (2 * window - page_size if tree else 0)


def whole_reserve(tokens: int, page_size: int) -> int:
    """The most slots of an ALL_PAGES token pool one request of ``tokens`` tokens (prompt and
    output) holds at once, its own and the tree's it locks: one per position, in whole pages."""
    return -(-tokens // page_size) * page_size


class PoolSlots:
    """Per running request, its slots in each extra pool of the model (none: a no-op)."""

    def __init__(
        self, model: ModelConfig, pools: Mapping[str, DevicePool], tree: Any, chunk_tokens: int
    ) -> None:
        spec = model.pools()
        roles = pool_roles(spec)
        self.roles = roles
        self.pools = pools
        self.tree = tree
        self.page_size = spec.page_size
        self.chunk_tokens = chunk_tokens
        self.interval = model.state_interval
        self.window_interval = model.window_interval
        self.windows: dict[str, int | None] = {}  # None: ALL_PAGES, no window
        for name in roles.token_pools:
            rule = roles.rules[name]
            if rule.kind is HitRuleKind.ALL_PAGES:
                self.windows[name] = None
            elif rule.kind is HitRuleKind.TRAILING_PAGES:
                self.windows[name] = rule.pages * spec.page_size
            else:
                raise ConfigError(f"pool {name!r}: a per-token pool needs a page or window rule")
        if len(roles.state_pools) > 1:
            raise ConfigError(f"one state pool per model, got {roles.state_pools}")
        self.state_pool = roles.state_pools[0] if roles.state_pools else None
        self.reserved = dict.fromkeys(self.windows, 0)  # by running requests, per token pool

    @property
    def active(self) -> bool:
        """Whether the model has extra pools (else requests use the plain lifecycle)."""
        return bool(self.windows) or self.state_pool is not None

    # ----- admission --------------------------------------------------------------------------
    def reserve(self, name: str, request: ServeRequest, prefix_len: int) -> int:
        """What ``request`` reserves in token pool ``name`` (see :func:`swa_reserve` and
        :func:`whole_reserve`)."""
        window = self.windows[name]
        if window is None:
            return whole_reserve(len(request.prompt) + request.max_new_tokens, self.page_size)
        chunk = max(1, min(self.chunk_tokens, len(request.prompt) - prefix_len))
        has_tree = self.tree is not None
        return swa_reserve(window, chunk, self.page_size, has_tree)

    def refusal(self, request: ServeRequest) -> str | None:
        """Why ``request`` can never run, even alone; None when it can."""
        for name in self.windows:
            need, size = self.reserve(name, request, 0), self.pools[name].size
            if need > size:
                what = "its tokens" if self.windows[name] is None else "its window and chunk"
                return f"{what} need {need} slots; the {name} pool has {size}"
        state = self.state_pool
        if state is not None:
            need = 1 + len(self._keep_points(request, 0, self.interval, 0))
            size = self.pools[state].size
            if need > size:
                return f"its state and snapshots need {need} slots; the {state} pool has {size}"
        return None

    def admit(
        self, request: ServeRequest, prefix_len: int, last: TreeNode | None, shared: int = 0
    ) -> PoolRequest | None:
        """The request's extra-pool state once admitted with a cached prefix of ``prefix_len``
        tokens ending at ``last``; ``shared``: :meth:`shared_end`, taken before the engine
        evicted for the request. None (nothing taken) when the pools cannot take it now."""
        state = PoolRequest(filled=prefix_len)
        if not self.active:
            return state
        for name in self.windows:
            need = self.reserve(name, request, prefix_len)
            if self.reserved[name] + need > self.pools[name].size:
                return None
            state.reserved[name] = need
        points = self._keep_points(request, prefix_len, self.interval, shared)
        if self.state_pool is not None and not self._admit_state(state, points, prefix_len, last):
            return None
        for name, need in state.reserved.items():
            self.reserved[name] += need
        if self.windows:
            self._admit_windows(state, prefix_len, last)
            state.keep_points = self._keep_points(request, prefix_len, self.window_interval, shared)
        return state

    def _admit_windows(self, state: PoolRequest, prefix_len: int, last: TreeNode | None) -> None:
        """Rows of the token pools: the cached prefix's window (shared, locked), -1 before."""
        context = self.pools[self.roles.anchor].size
        shared = path_slots(self.tree, last) if last is not None and prefix_len else {}
        for name, window in self.windows.items():
            row = torch.full((context,), -1, dtype=torch.int64)
            hit = shared.get(name)
            if hit is not None and prefix_len:
                lo = 0 if window is None else max(0, prefix_len - window)
                row[lo:prefix_len] = hit[lo:prefix_len]
                if bool((row[lo:prefix_len] < 0).any()):
                    raise RuntimeError(f"a cached prefix without its {name} window was matched")
            state.rows[name] = row
            state.owned[name] = torch.zeros(context, dtype=torch.bool)
            state.windows[name] = window
        windowed = [w for w in self.windows.values() if w is not None]
        state.trimmed = max(0, prefix_len - min(windowed)) if windowed else 0
        if last is not None and prefix_len:
            lock_windows(self.tree, state, last)

    def _admit_state(
        self, state: PoolRequest, positions: list[int], prefix_len: int, last: TreeNode | None
    ) -> bool:
        """Take the working slot and the snapshot slots; the prefix's snapshot, if any, stays
        locked for the first chunk to start from."""
        name = self.state_pool
        assert name is not None
        hit = None
        if prefix_len and last is not None:
            hit = self.tree.ledger.data(last, name)
            if hit is None:
                raise RuntimeError(f"a cached prefix without its {name} snapshot was matched")
            self.tree.ledger.lock(last, name)  # not evicted to make room for the request
        slots = self._alloc(name, 1 + len(positions))
        if slots is None:
            if hit is not None:
                self.tree.ledger.unlock(last, name)
            return False
        state.state_pool, state.state_slot = name, int(slots[0])
        state.snapshots = dict(zip(positions, slots[1:].tolist(), strict=True))
        if hit is not None:
            state.state_from, state.state_lock = int(hit[0]), last
        return True

    def _keep_points(
        self, request: ServeRequest, prefix_len: int, interval: int, shared: int
    ) -> list[int]:
        """The positions after ``prefix_len`` where the request leaves an extra pool's data in
        the tree: every ``interval`` tokens, its reusable prompt's end, ``shared`` (see
        :meth:`shared_end`) and its final end; none without a tree."""
        if self.tree is None:
            return []
        ps = self.page_size
        final = (len(request.prompt) + request.max_new_tokens - 1) // ps * ps
        ends = {(len(request.prompt) - 1) // ps * ps, final, shared}
        ends.update(range(interval, final + 1, interval))
        return sorted(p for p in ends if prefix_len < p <= final)

    def shared_end(self, request: ServeRequest) -> int:
        """Where the request's prompt leaves what the tree holds of the anchor, whatever the
        other pools hold there: a prefix others share (a system prompt) that has no window or
        snapshot at its end gets one from the first request that recomputes it. Taken before
        the engine evicts for the request, which may take that prefix."""
        if self.tree is None or not len(request.key):
            return 0
        shared, _ = RadixCache.peek_prefix(self.tree, request.key)
        return shared // self.page_size * self.page_size

    def keep_point_in(self, state: PoolRequest | None, start: int, end: int) -> bool:
        """Whether a position in ``(start, end]`` is one where the request leaves data in the
        tree (a window or a snapshot): the chunk that computed it commits before its window
        is trimmed."""
        if state is None:
            return False
        points = [*state.keep_points, *state.snapshots]
        return any(start < p <= end for p in points)

    def _alloc(self, name: str, count: int) -> torch.Tensor | None:
        """``count`` slots of owner pool ``name``, evicting the tree's unlocked data if short."""
        pool = self.pools[name]
        slots = pool.alloc(count)
        if slots is None and self.tree is not None:
            self.tree.evict_pool(name, count - pool.available_size)
            slots = pool.alloc(count)
        return slots

    # ----- chunks -----------------------------------------------------------------------------
    def fill(self, state: PoolRequest | None, chunk: ChunkInput) -> None:
        """Give ``chunk`` its extra pools' inputs, taking the token pools' slots it needs."""
        if state is None or not self.active:
            return
        end = chunk.end
        top = math.ceil(end / self.page_size) * self.page_size
        if top > state.filled:
            for name in self.windows:
                slots = self._alloc(name, top - state.filled)
                if slots is None:  # the reservation says this cannot happen
                    raise RuntimeError(f"the {name} pool ran out of slots despite reservations")
                state.rows[name][state.filled : top] = slots
                state.owned[name][state.filled : top] = True
            state.filled = top
        chunk.pool_slots = {name: state.rows[name][:end] for name in self.windows}
        chunk.state_slot, chunk.state_from = state.state_slot, state.state_from
        chunk.snapshots = {p: s for p, s in state.snapshots.items() if chunk.start < p <= end}

    def after_chunk(self, state: PoolRequest | None, kv_len: int) -> None:
        """Release the snapshot the first chunk started from; free the token pools' pages that
        left the window."""
        if state is not None:
            self._release_start(state)
        if state is not None and state.windows:
            owners = {name: self.pools[name] for name in state.windows}
            trim_windows(state, kv_len, self.page_size, owners)

    # ----- commits and finish -----------------------------------------------------------------
    def commit(self, cached: CachedRequest, state: PoolRequest | None) -> None:
        """Commit a running request's computed pages (every pool) to the tree."""
        if state is None or not self.active:
            self.tree.cache_unfinished_req(cached)
        else:
            cache_unfinished_bundle(self.tree, cached, state)

    def finish(self, cached: CachedRequest, state: PoolRequest | None) -> None:
        """Commit a finished request to the tree (if any) and free the rest of what it holds."""
        if self.tree is not None:
            if state is None or not self.active:
                self.tree.cache_finished_req(cached)
            else:
                cache_finished_bundle(self.tree, cached, state)
        if state is not None:
            self.release(state)

    def _release_start(self, state: PoolRequest) -> None:
        """The first chunk has read its starting snapshot: the tree may evict it again."""
        if state.state_lock is not None:
            self.tree.ledger.unlock(state.state_lock, state.state_pool)
        state.state_from, state.state_lock = None, None

    def release(self, state: PoolRequest) -> None:
        """Free what a request still holds in the extra pools (after its commit, or without a
        tree: everything; a HiSparse request that decoded from its hot buffer: its slots past
        what it committed as it entered) and give its reservation back."""
        for name in state.windows:
            own = state.own_slots(name)
            if len(own):
                self.pools[name].free(torch.sort(own).values)
            state.owned[name][:] = False
        if self.tree is not None:
            unlock_windows(self.tree, state)
            self._release_start(state)
        leftover = list(state.snapshots.values())
        if state.state_slot is not None:
            leftover.append(state.state_slot)
        if leftover and self.state_pool is not None:
            self.pools[self.state_pool].free(torch.tensor(sorted(leftover), dtype=torch.int64))
        state.snapshots, state.state_slot = {}, None
        for name, need in state.reserved.items():
            self.reserved[name] -= need
        state.reserved = {}
