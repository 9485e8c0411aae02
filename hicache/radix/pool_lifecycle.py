"""Committing a running request's extra pools into a tree over many pools: the pool-aware twin of
:mod:`hicache.radix.lifecycle`, for a :class:`~hicache.radix.shadow.ShadowRadixCache` (or a tree
with its API: ``insert_bundle``, ``match_anchor``, ``ledger``, ``allocators``, ``roles``).

A request keeps, beside its anchor row (the req-to-token table), a :class:`PoolRequest`:

* per extra per-token pool (SWA), a row of slots per position (-1 where it holds none) and which
  of them are its own. Its own slots leave the row once no query and no commit needs them
  (:func:`trim_windows`: a page ``[a, a + ps)`` goes once ``a + ps <= K - W``, ``K`` the
  page-aligned length computed so far and ``W`` the pool's window, so the next query's window
  and the window of the key a commit inserts are always held); slots it shares from the tree
  (the window of its cached prefix) are held by a pool lock on its last node
  (``tree.ledger.lock(node, pool)``) and never freed by the request. A token pool under an
  ALL_PAGES rule (dsv4's ``c128``) has no window (``None``): its row keeps every position, a
  commit gives the tree all of its own slots, and its lock holds the whole path;
* the positions at which it snapshots its recurrent state, with the slot of each, until a
  commit hands them to the tree at a node end; and the *keep points* where it leaves a token
  pool's window in the tree (every ``window_interval`` tokens, its reusable prompt's end): the
  engine commits in the step that computes one, before the trim lets go of its window.

A commit inserts the anchor slots with each token pool's own slots of the windows before the
keep points the key reaches (and, when the request finished, before the key's end; -1
elsewhere), then each
snapshot whose position the committed key reaches, ascending, as
``insert_bundle(key[:p], anchor[:p], {pool: [slot]})``: the tree splits a node at ``p`` so the
snapshot lands on a node end. What the tree did not keep is freed, except (before the request
ends) the own slots its window still needs where the tree holds nothing; the row then points at
the tree's slots wherever the tree holds them, and the pool lock moves to the new last node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hicache.errors import InvalidArgumentError
from hicache.radix.shadow_rules import pool_indices

if TYPE_CHECKING:
    from hicache.keys import RadixKey
    from hicache.radix.lifecycle import CachedRequest
    from hicache.radix.node import TreeNode

__all__ = [
    "PoolRequest",
    "cache_finished_bundle",
    "cache_unfinished_bundle",
    "lock_windows",
    "path_anchor",
    "path_slots",
    "trim_windows",
    "unlock_windows",
]


@dataclass(slots=True)
class PoolRequest:
    """The extra pools' side of a running request (see the module docstring)."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # token pool -> slot a position
    owned: dict[str, torch.Tensor] = field(default_factory=dict)  # token pool -> bool a position
    # token pool -> W, in tokens; None: no window (an ALL_PAGES pool keeps every position)
    windows: dict[str, int | None] = field(default_factory=dict)
    filled: int = 0  # positions 0 .. filled - 1 have token-pool slots (or -1) in the rows
    trimmed: int = 0  # positions before this were let go (-1 in every windowed row)
    snapshots: dict[int, int] = field(default_factory=dict)  # position -> state slot, not yet given
    keep_points: list[int] = field(default_factory=list)  # where a window goes to the tree, not yet
    state_pool: str | None = None  # the per-sequence owner pool the snapshots are slots of
    state_slot: int | None = None  # the working state slot (the request's, never the tree's)
    state_from: int | None = None  # the cached snapshot its first chunk starts from
    state_lock: TreeNode | None = None  # the node whose snapshot that is, pool-locked till then
    locked: TreeNode | None = None  # the node whose token-pool locks the request holds
    reserved: dict[str, int] = field(default_factory=dict)  # what admission set aside, per pool

    def own_slots(self, name: str) -> torch.Tensor:
        """The request's own slots of token pool ``name``, in position order."""
        return self.rows[name][self.owned[name]]


# ----- windows and locks ----------------------------------------------------------------------
def trim_windows(req: PoolRequest, kv_len: int, page_size: int, allocators: Any) -> None:
    """Let go of every position no query and no commit needs once ``kv_len`` tokens are
    computed: before ``K - W`` (``K`` = ``kv_len`` rounded down to a page). Own slots there are
    freed to ``allocators[pool]``; shared ones are only forgotten (-1). A pool without a window
    keeps everything."""
    windowed = {name: w for name, w in req.windows.items() if w is not None}
    for name, window in windowed.items():
        keep_from = kv_len // page_size * page_size - window
        if keep_from <= req.trimmed:
            continue
        row, owned = req.rows[name], req.owned[name]
        span = slice(req.trimmed, keep_from)
        mine = row[span][owned[span]]
        if len(mine):
            allocators[name].free(mine.clone())
        row[span] = -1
        owned[span] = False
    keep = min((kv_len // page_size * page_size - w for w in windowed.values()), default=0)
    req.trimmed = max(req.trimmed, keep)


def lock_windows(tree: Any, req: PoolRequest, node: TreeNode) -> None:
    """Take each token pool's lock on ``node`` (its window) for the request, then drop the
    locks it held before (in that order, so nodes both cover are never unlocked meanwhile)."""
    old = req.locked
    req.locked = None
    if node.parent is not None and req.windows:
        for name in req.windows:
            tree.ledger.lock(node, name)
        req.locked = node
    if old is not None:
        for name in req.windows:
            tree.ledger.unlock(old, name)


def unlock_windows(tree: Any, req: PoolRequest) -> None:
    """Drop the request's token-pool locks (it finished, or was refused)."""
    if req.locked is not None:
        for name in req.windows:
            tree.ledger.unlock(req.locked, name)
    req.locked = None


def path_anchor(node: TreeNode) -> torch.Tensor:
    """The anchor's device slots along the path that ends at ``node`` (every node holds them)."""
    values = []
    for n in reversed(node.path_to_root()):
        if n.value is None:
            raise InvalidArgumentError(f"{n!r} on the path holds no device slots")
        values.append(n.value)
    return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)


def path_slots(tree: Any, node: TreeNode) -> dict[str, torch.Tensor | None]:
    """Each extra pool's slots along the path that ends at ``node`` (see
    :func:`~hicache.radix.shadow_rules.pool_indices`): a token pool's slot per position (-1
    where it holds none), a state pool's snapshot at ``node``'s end."""
    path = list(reversed(node.path_to_root()))
    return pool_indices(tree.roles, path, path_anchor(node))


# ----- commits --------------------------------------------------------------------------------
def cache_unfinished_bundle(tree: Any, req: CachedRequest, pools: PoolRequest) -> None:
    """Commit what a running request has computed, every pool, and move its locks to its new
    last node; its rows then point at the tree's slots wherever the tree holds them."""
    key, row, given = _commit(tree, req, pools, finished=False)
    if not len(key):
        return
    match = tree.match_anchor(key)
    row[: match.prefix_len] = match.device_indices
    node = match.last_device_node
    _commit_snapshots(tree, key, match.device_indices, pools)
    _settle_token_pools(tree, pools, node, given, len(key), finished=False)
    tree.inc_lock_ref(node)
    lock_windows(tree, pools, node)
    if req.last_node is not None:
        tree.dec_lock_ref(req.last_node)
    req.last_node = node
    req.prefix_indices = match.device_indices


def cache_finished_bundle(tree: Any, req: CachedRequest, pools: PoolRequest) -> None:
    """Commit a finished request, every pool; free whatever of it the tree did not keep (its
    leftover anchor slots and row, its own token-pool slots, snapshots past the key), release
    its locks. The working state slot is the caller's to free."""
    key, row, given = _commit(tree, req, pools, finished=True)
    if req.allocated > len(key):
        tree.allocator.free(row[len(key) : req.allocated].clone())
    node = None
    if len(key):
        match = tree.match_anchor(key)
        node = match.last_device_node
        _commit_snapshots(tree, key, match.device_indices, pools)
    _settle_token_pools(tree, pools, node, given, len(key), finished=True)
    if pools.state_pool is not None and pools.snapshots:
        leftover = torch.tensor(sorted(pools.snapshots.values()), dtype=torch.int64)
        tree.allocators[pools.state_pool].free(leftover)
    pools.snapshots.clear()
    unlock_windows(tree, pools)
    if req.last_node is not None:
        tree.dec_lock_ref(req.last_node)
    tree.req_to_token.free(req.req_pool_idx)
    req.last_node = None
    req.allocated = 0


def _commit(
    tree: Any, req: CachedRequest, pools: PoolRequest, finished: bool
) -> tuple[RadixKey, torch.Tensor, dict[str, torch.Tensor]]:
    """Insert the request's whole pages, the anchor's and each token pool's own slots (-1
    elsewhere), and free anchor duplicates. Returns (key, anchor row, the token slots given)."""
    if tree.allocator is None or tree.req_to_token is None:
        raise InvalidArgumentError("the request lifecycle needs an allocator and a req_to_token")
    if req.kv_len > req.allocated or req.kv_len > len(req.token_ids):
        raise InvalidArgumentError(f"request {req.rid}: kv_len {req.kv_len} is inconsistent")
    key = req.key(tree.page_size)
    row = tree.req_to_token.table[req.req_pool_idx]
    kv = row[: len(key)].clone()
    given = {
        name: torch.where(
            pools.owned[name][: len(key)] & _kept_windows(pools, window, len(key), finished),
            pools.rows[name][: len(key)],
            -1,
        )
        for name, window in pools.windows.items()
    }
    if len(key):
        shared = len(req.prefix_indices)
        already = tree.insert_bundle(key, kv, given, req.priority).already
        if already > shared:  # another request cached these pages meanwhile: duplicates
            tree.allocator.free(kv[shared:already])
    return key, row, given


def _kept_windows(
    pools: PoolRequest, window: int | None, key_len: int, finished: bool
) -> torch.Tensor:
    """Which positions of a ``key_len`` key a commit gives the tree of a ``window`` pool: the
    window before each keep point the key reaches and, once the request finished, before the
    key's end. A running request's commit (a prefill chunk) keeps the window at its end: the
    keep points are where windows are worth their bytes. No window: every position."""
    if window is None:
        return torch.ones(key_len, dtype=torch.bool)
    mask = torch.zeros(key_len, dtype=torch.bool)
    ends = [p for p in pools.keep_points if p <= key_len] + ([key_len] if finished else [])
    for end in ends:
        mask[max(0, end - window) : end] = True
    return mask


def _window_start(pools: PoolRequest, window: int | None, key_len: int) -> int:
    """Where the windows a commit of a ``key_len`` key gave begin (the earliest keep point's
    the key reaches, or the key end's; 0 without a window)."""
    if window is None:
        return 0
    reached = [p for p in pools.keep_points if p <= key_len]
    return max(0, min([*reached, key_len]) - window)


def _commit_snapshots(tree: Any, key: RadixKey, anchor: torch.Tensor, pools: PoolRequest) -> None:
    """Give the tree each snapshot at a position the committed ``key`` reaches, ascending;
    ``anchor`` holds the tree's slots of the key. A node end that has a snapshot already keeps
    it, and ours is freed."""
    name = pools.state_pool
    for position in sorted(p for p in pools.snapshots if p <= len(key)):
        slot = torch.tensor([pools.snapshots.pop(position)], dtype=torch.int64)
        result = tree.insert_bundle(key.slice(0, position), anchor[:position], {name: slot})
        if len(result.unused[name]):
            tree.allocators[name].free(result.unused[name])


def _settle_token_pools(
    tree: Any,
    pools: PoolRequest,
    node: TreeNode | None,
    given: dict[str, torch.Tensor],
    key_len: int,
    finished: bool,
) -> None:
    """After an insert: own slots the tree kept become the tree's; own slots it did not keep
    are freed where the tree holds the position (the row takes the tree's slot), kept while the
    request still needs them where it does not, and all freed once the request is finished.
    Only the windows the commit gave are looked at (from the earliest keep point's on): what
    lies before them was let go. The keep points the key reached are done."""
    tree_slots = path_slots(tree, node) if node is not None and pools.windows else {}
    for name, window in pools.windows.items():
        row, owned = pools.rows[name], pools.owned[name]
        lo = _window_start(pools, window, key_len)
        held = tree_slots.get(name)
        held = held[lo:key_len] if held is not None else torch.empty(0, dtype=torch.int64)
        held = torch.cat([held, torch.full((key_len - lo - len(held),), -1, dtype=torch.int64)])
        span = slice(lo, key_len)
        gave = given[name][span]
        owned[span] &= ~((gave >= 0) & (held == gave))  # the tree kept those: its own now
        duplicate = owned[span] & (held >= 0)
        free = row[span][duplicate]
        row[span] = torch.where(held >= 0, held, row[span])
        owned[span] &= ~duplicate
        if finished:
            free = torch.cat([free, row[owned]])
            owned[:] = False
        if len(free):
            tree.allocators[name].free(torch.sort(free).values)
    pools.keep_points = [p for p in pools.keep_points if p > key_len]
