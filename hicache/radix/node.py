"""A node of the radix tree: one span of tokens and where its KV lives."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["TreeNode"]


class TreeNode:
    """One span of tokens (``key``: packed units) that requests share.

    ``value`` holds the device slot indices of the span (``None`` once evicted from the device,
    and always ``None`` in a simulated tree); ``host_value`` its host pages (one per token
    page) once backed up; ``hash_value`` the chained page hashes when computed. ``lock_ref``
    counts the requests and unexpired pins using the span (a locked node is never evicted).

    ``pool_values`` and ``pool_locks`` are for trees over several pools (ShadowRadixCache): the
    node's data in each extra pool (``None`` once that pool dropped it) and each pool's lock
    counts; plain trees leave them ``None``. In the tiered cache, ``pool_host`` holds each extra
    pool's host copy (host pages, or a snapshot's host page) and ``pool_stored`` the extra pools
    whose data here is known to be in L3.

    Who writes which field: every layer may read every field; each is written only by the layer
    listed, in the modules named (a new writer elsewhere goes in this table, or calls a method of
    the layer that owns the field):

    ==========================  ==================================================================
    layer (modules)             fields it writes
    ==========================  ==================================================================
    radix/ tree (tree.py,       ``id``, ``key``, ``length``, ``parent``, ``children``,
    shadow.py, eviction.py,     ``namespace``, ``creation_time`` (structure: new nodes, splits,
    slru.py)                    detaches); ``value`` and ``lock_ref`` (device slots and the tree
                                lock; other layers change them through tree operations such as
                                ``add_leaf``, ``release_device_slots``, ``restore_device_slots``,
                                ``inc_lock_ref``); ``hit_count``, ``last_access_time``,
                                ``access_tick``, ``priority`` (matches and inserts);
                                ``heap_version`` (the eviction heap); ``protected`` (SLRU)
    radix/ ledger               ``pool_values``, ``pool_locks``: only through ``tree.ledger``
    (pool_ledger.py)
    radix/ split (tree.py       cuts ``host_value`` and ``hash_value`` at the split page and
    ``split_span``)             copies ``in_storage`` to the upper node: the one place radix/
                                writes the tiers' fields (tiering's ``split_span`` cuts
                                ``pool_host`` and ``pool_stored`` in tiering/host/pool.py)
    tiering/host (backup.py,    ``host_value`` (a backup sets it, host eviction clears it, a
    eviction.py, pool.py)       leaf hung for pages computed on host gets it), ``pool_host``,
                                ``pool_stored`` (dropped with a pool's host copy), and the
                                ``priority`` of a host-only leaf it hangs (``hang_host_leaf``)
    tiering/l3 (writer.py,      ``in_storage`` and ``pool_stored`` (write acknowledgements),
    bundler.py,                 ``hash_value`` (page hashes, computed once); a prefetched leaf's
    prefetch_insert.py)         ``host_value``, ``hash_value``, ``in_storage``, ``pool_stored``
    tiering/cache.py            ``in_storage`` and ``pool_stored`` cleared when L3 is detached
    everything else (sparse/,   nothing: they read nodes (match results, peeks) and change the
    serving/, scheduling/,      tree only through its methods
    server/, workloads/, tools)
    ==========================  ==================================================================
    """

    __slots__ = (
        "access_tick",
        "children",
        "creation_time",
        "hash_value",
        "heap_version",
        "hit_count",
        "host_value",
        "id",
        "in_storage",
        "key",
        "last_access_time",
        "length",
        "lock_ref",
        "namespace",
        "parent",
        "pool_host",
        "pool_locks",
        "pool_stored",
        "pool_values",
        "priority",
        "protected",
        "value",
    )

    def __init__(
        self, node_id: int, key: bytes, length: int, parent: TreeNode | None, now: float
    ) -> None:
        self.id = node_id
        self.key = key
        self.length = length  # in units (tokens, or token pairs for bigram keys)
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.hash_value: list[bytes] | None = None
        self.in_storage = False
        self.lock_ref = 0
        self.hit_count = 0
        self.priority = 0
        self.protected = False  # SLRU: in the protected segment
        self.creation_time = now
        self.last_access_time = now
        self.access_tick = 0
        self.heap_version = 0
        self.namespace: tuple[str | None, bool] = (None, False)
        self.pool_values: dict[str, torch.Tensor | None] | None = None
        self.pool_locks: dict[str, dict[int, int]] | None = None
        self.pool_host: dict[str, torch.Tensor | None] | None = None
        self.pool_stored: frozenset[str] = frozenset()

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={self.length}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)})"
        )

    def path_to_root(self) -> list[TreeNode]:
        """This node and its ancestors, nearest first, excluding the namespace root."""
        out = []
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out
