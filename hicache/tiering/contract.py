"""The engine's one way into the tiered cache: :class:`TieredCache`, and who calls what when.

An engine (``hicache/serving``, ``hicache/server``, ``hicache/sparse``, ...) holds a
:class:`~hicache.tiering.cache.HiRadixCache` and calls only what :class:`TieredCache` declares,
beside the radix tree's own surface (insert, lock, evict, ``cache_*_req``: see
:class:`~hicache.radix.tree.RadixCache`). The cache's parts (its prefetcher, backups, host
evictor, L3 writer, storage tier, controller, bundler) are its own business:
``tests/test_tier_contract.py`` fails on an attribute of one of those names outside
``hicache/tiering/``.

**Threads.** Every call below is made on the thread that runs the event loop the cache was
opened on (the scheduler's), one at a time. The L3 reads and writes run as tasks on that loop;
device <-> host copies run on their own streams. The only thing another thread touches is a
returned :class:`~hicache.tiering.common.parts.GroupTransfer`: the forward pass, in a worker
thread, waits on its per-layer events (``wait_layer``) while the loop goes on.

**Sync calls** never wait for I/O: L3 work is only queued or started, and its results come in
through ``check_events``. A few wait for a device -> host copy (memory bandwidth, not I/O):
``backup_now``, and whatever evicts device memory under ``write_back`` (``init_load_back``
making room, the tree's ``evict``); ``copy_to_host`` returns its transfer for the caller to
synchronize. None is called from the forward's thread. **Async calls** (``wait_for_activity``,
``attach_l3``, ``detach_l3``, ``quiesce``, ``close``) are coroutines awaited on the cache's
loop.

**One scheduling round**, in this order:

1. :meth:`~TieredCache.check_events`: apply what finished meanwhile (device-to-host copies, L3
   write acknowledgements, finished prefetches, whose pages are then in the tree).
2. Admission, per waiting request in the scheduler's order (``peek_tiers`` ranks them and
   touches nothing): :meth:`~TieredCache.prefetch_may_run` (False: its L3 read is still worth
   waiting for, leave it queued; True stops a read still running). Whether to read its prefix
   back from L3 (``l3_enabled``, ``prefetch_threshold_tokens``, ``prefetch_shortfall_tokens``,
   ``prefetch_yielded``, ``prefetch_reading``, ``l3_read_bytes_per_s`` and ``page_bytes``), then
   ``match_prefix(key, count_hits=False)`` and :meth:`~TieredCache.prefetch_start`. A request
   that starts: ``match_prefix(key)``, ``prefetch_inserted_tokens`` (its L3 hit, read not
   taken), :meth:`~TieredCache.init_load_back` of its host hit and
   :meth:`~TieredCache.ready_to_load_host_cache` (the transfers its forward waits on), the
   engine's lock on the prefix, then :meth:`~TieredCache.prefetch_release`.
3. The forward step (a worker thread: ``wait_layer`` only). HiSparse, on the loop between
   forwards: ``prefetch_yield_reserved``, ``backup_now``, ``alloc_host_pages``,
   ``alloc_pool_host_pages``, ``copy_to_host``, ``insert_host_pages``.
4. A request that fails or is cancelled while queued: :meth:`~TieredCache.prefetch_terminate`
   then :meth:`~TieredCache.prefetch_release`; one let go after admission:
   :meth:`~TieredCache.release_request`.
5. Nothing to run: ``await wait_for_activity(timeout_s)`` (a finished read or write wakes it).

Operators' calls (``evict_host``, ``attach_l3``, ``detach_l3``) come from handlers on the same
loop, so they run while the engine awaits (its forward, ``wait_for_activity``), never inside a
round's sync calls; ``wrap_l3_backend`` (a limit or a timer around the backend) comes right
after opening, before the first round. Shutdown awaits ``quiesce`` then ``close``.

**Ownership.** Pages a prefetch inserts are the tree's; with ``reserve`` they stay kept for the
request until ``prefetch_release``, which the engine calls exactly once for every request it
started a prefetch for (admitted, failed or gone). The slots ``match_prefix`` and
``init_load_back`` return are the tree's: the engine locks the node (``inc_lock_ref``) before
the round ends and reads loaded slots only after their transfer. Host pages from
``alloc_host_pages`` / ``alloc_pool_host_pages`` are the caller's until it frees them or hands
them to ``insert_host_pages``. ``copy_to_host``'s slots and pages stay untouched until its
transfer is synchronized. Nodes ``backup_now`` puts on host are the tree's: a caller that needs
their pages protects them on ``host`` (``protect`` / ``release``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from hicache.keys import RadixKey
from hicache.tiering.common.policies import TerminationReason
from hicache.tiering.host.pool import ComputedHostPages

if TYPE_CHECKING:
    from hicache.backends.base import StorageBackend
    from hicache.keys import StorageFormat
    from hicache.pools.host import HostPool
    from hicache.radix.lifecycle import CachedRequest
    from hicache.radix.node import TreeNode
    from hicache.radix.shadow import ShadowMatchResult
    from hicache.radix.shadow_rules import PoolRoles
    from hicache.radix.tier_peek import TierPeek
    from hicache.radix.tree import MatchResult
    from hicache.tiering.common.metrics import HiCacheMetrics
    from hicache.tiering.common.parts import GroupTransfer
    from hicache.tiering.controller import HiCacheController
    from hicache.tiering.host.backup import Backups
    from hicache.tiering.host.eviction import HostEvictor
    from hicache.tiering.l3.prefetcher import Prefetcher
    from hicache.tiering.l3.storage_tier import StorageTier
    from hicache.tiering.l3.writer import L3Writer

__all__ = ["ComputedHostPages", "PrefetchMode", "TieredCache", "TieredCacheOps"]


@dataclass(frozen=True, slots=True)
class PrefetchMode:
    """How a prefetch reads (:meth:`TieredCache.prefetch_start`). ``reserve``: keep what it
    inserts for its request until ``prefetch_release``; ``urgent``: for a request about to run,
    past the prefetch share of host memory; ``whole``: all pages L3 holds or none."""

    reserve: bool = False
    urgent: bool = False
    whole: bool = False


@runtime_checkable
class TieredCache(Protocol):
    """What an engine may call on a tiered cache (the module's docstring says when)."""

    # ----- the tree and its pools -----------------------------------------------------------
    @property
    def page_size(self) -> int: ...
    @property
    def roles(self) -> PoolRoles:
        """Which pool anchors the tree, and the extra pools' kinds."""

    @property
    def req_to_token(self) -> Any:
        """The request lifecycle's table the engine gave the tree (a ``ReqToTokenPool``)."""

    @property
    def metrics(self) -> HiCacheMetrics:
        """The cache's counters and gauges (``as_dict()``, ``add(name)``)."""

    @property
    def host(self) -> HostPool:
        """The anchor pool's host pool (``protect`` / ``release`` / ``free`` its pages)."""

    @property
    def host_pools(self) -> Mapping[str, HostPool]:
        """Every pool's host pool, by pool name (sidecars included)."""

    def check_events(self) -> None:
        """Apply finished copies, L3 write acknowledgements and prefetches: first each round."""

    def match_prefix(self, key: RadixKey, count_hits: bool = True) -> ShadowMatchResult:
        """The device hit, then the host hit after it; ``count_hits=False`` touches no policy."""

    def peek_tiers(self, key: RadixKey) -> TierPeek:
        """What ``match_prefix`` would find on device and host, touching nothing."""

    def init_load_back(self, node: TreeNode, mem_quota: int | None = None) -> tuple[Any, TreeNode]:
        """Start loading the host part of the prefix ending at ``node``: (the anchor slots
        loaded, the node the device prefix now ends at); all or nothing."""

    def ready_to_load_host_cache(self) -> list[GroupTransfer]:
        """The loads started since the last call, for the forward to wait on per layer."""

    def release_request(self, req: CachedRequest) -> None:
        """An aborted request: stop its prefetch, free its own slots and row, drop its lock."""

    # ----- L3 prefetch, per request ---------------------------------------------------------
    @property
    def prefetch_threshold_tokens(self) -> int:
        """The fewest tokens a prefetch reads; a shortfall under it is not read."""

    def prefetch_start(
        self, rid: str, key: RadixKey, match: MatchResult, mode: PrefetchMode = PrefetchMode()
    ) -> bool:
        """Start reading ``key``'s pages past ``match``'s device and host hit from L3, for
        ``rid`` and read as ``mode`` says; whether one started."""

    def prefetch_may_run(self, rid: str) -> bool:
        """Whether ``rid`` may be scheduled now (its stop policy); stops its read when so."""

    def prefetch_reading(self, rid: str) -> bool:
        """Whether ``rid`` has a read not stopped or settled yet."""

    def prefetch_shortfall_tokens(self, rid: str) -> int:
        """Tokens L3 held for ``rid``'s last read that it could not read (no host room)."""

    def prefetch_yielded(self, rid: str) -> bool:
        """Whether what ``rid``'s read kept went to ``prefetch_yield_reserved`` since."""

    def prefetch_inserted_tokens(self, rid: str) -> int:
        """Tokens ``rid``'s reads inserted so far (its L3 hit); read, not taken."""

    def prefetch_release(self, rid: str) -> int:
        """``rid`` was admitted or is gone: drop what its reads keep; the tokens inserted."""

    def prefetch_terminate(
        self, rid: str, reason: TerminationReason = TerminationReason.ABORTED
    ) -> None:
        """Stop ``rid``'s read now, keeping what arrived."""

    def prefetch_yield_reserved(self) -> int:
        """Let host eviction take what reads keep for waiting requests (a running request
        needs host memory); how many pages that was."""

    # ----- host memory ----------------------------------------------------------------------
    def alloc_host_pages(self, n_pages: int) -> torch.Tensor | None:
        """``n_pages`` anchor host pages (host eviction makes room), the caller's; or None."""

    def alloc_pool_host_pages(self, pool: str, count: int) -> torch.Tensor | None:
        """``count`` host pages of extra pool ``pool``, the caller's; or None."""

    def copy_to_host(
        self, device_slots: torch.Tensor, host_pages: torch.Tensor, owner: str | None = None
    ) -> GroupTransfer:
        """Start copying ``device_slots`` of ``owner``'s group (the anchor's when None) into
        ``host_pages``; the caller synchronizes the transfer."""

    def backup_now(self, node: TreeNode) -> bool:
        """Whether ``node``'s anchor pages are on host once this returns: copied now (waiting
        for the copy) when it had none, else its copy still in flight waited for."""

    def insert_host_pages(self, computed: ComputedHostPages) -> int:
        """Hang pages computed on host under their key's cached path as host-only nodes, which
        go to L3 as a backup does. Returns how many of ``computed.anchor_pages`` the tree took
        (the last ones); those and every extra page are the cache's after the call, the rest
        stay the caller's."""

    def evict_host(self, num_tokens: int) -> int:
        """Evict host-only leaves for ``num_tokens``; the tokens evicted."""

    # ----- L3 -------------------------------------------------------------------------------
    @property
    def l3_enabled(self) -> bool:
        """Whether an L3 backend is attached."""

    @property
    def l3_backend(self) -> StorageBackend | None:
        """The attached backend, for its stats and a scan of what it holds; None without."""

    def wrap_l3_backend(self, wrap: Callable[[StorageBackend], StorageBackend]) -> bool:
        """Put ``wrap(backend)`` in the attached backend's place (a bandwidth limit, a timer),
        so every later L3 call goes through it; whether one was attached. Called right after
        opening, before any L3 work (an operator's flag, a benchmark)."""

    @property
    def page_formats(self) -> Mapping[str, StorageFormat]:
        """Each pool's format of its L3 objects (the digest in their keys)."""

    @property
    def l3_read_bytes_per_s(self) -> float | None:
        """Measured L3 read rate, smoothed; None before a read."""

    @property
    def l3_queued_pages(self) -> int:
        """Pages queued for L3 writes."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one token page of the anchor's group (what a token costs in every tier)."""

    async def wait_for_activity(self, timeout_s: float) -> None:
        """Return once a read or write finished since the last wait, or after ``timeout_s``."""

    async def attach_l3(self, url: str) -> None:
        """Connect the backend at ``url`` at run time."""

    async def detach_l3(self, drain_s: float = 10.0) -> bool:
        """Stop using L3 (queued writes get ``drain_s``); whether one was attached."""

    async def quiesce(self, timeout_s: float = 60.0) -> None:
        """Wait until every queued write and running prefetch has settled."""

    async def close(self, drain_s: float = 0.0) -> None:
        """Apply finished work, give queued L3 writes ``drain_s``, close L3."""


class TieredCacheOps:
    """:class:`TieredCache`'s calls that are its parts' (documented there), as
    :class:`~hicache.tiering.cache.HiRadixCache` has them: thin delegations."""

    controller: HiCacheController
    storage: StorageTier
    prefetcher: Prefetcher
    backups: Backups
    host_evictor: HostEvictor
    writer: L3Writer

    @property
    def idle(self) -> bool:
        """Nothing in flight: no copy to host, L3 write or prefetch unsettled."""
        return not (self.backups.in_flight or self.prefetcher.running or self.storage.busy)

    def check_events(self) -> None:
        """Apply finished device-to-host copies, L3 writes and prefetches; once per step."""
        self.backups.settle()
        self.writer.apply_acks()
        self.prefetcher.apply_finished()

    @property
    def host_pools(self) -> Mapping[str, HostPool]:
        return self.controller.host_pools

    @property
    def prefetch_threshold_tokens(self) -> int:
        return self.prefetcher.config.threshold_tokens

    def prefetch_start(
        self, rid: str, key: RadixKey, match: MatchResult, mode: PrefetchMode = PrefetchMode()
    ) -> bool:
        return self.prefetcher.start(rid, key, match, mode.reserve, mode.urgent, mode.whole)

    def prefetch_may_run(self, rid: str) -> bool:
        return self.prefetcher.may_run(rid)

    def prefetch_reading(self, rid: str) -> bool:
        return self.prefetcher.reading(rid)

    def prefetch_shortfall_tokens(self, rid: str) -> int:
        return self.prefetcher.shortfall_tokens(rid)

    def prefetch_yielded(self, rid: str) -> bool:
        return self.prefetcher.yielded(rid)

    def prefetch_inserted_tokens(self, rid: str) -> int:
        return self.prefetcher.inserted_tokens.get(rid, 0)

    def prefetch_release(self, rid: str) -> int:
        return self.prefetcher.release(rid)

    def prefetch_terminate(
        self, rid: str, reason: TerminationReason = TerminationReason.ABORTED
    ) -> None:
        self.prefetcher.terminate(rid, reason)

    def prefetch_yield_reserved(self) -> int:
        return self.prefetcher.yield_reserved()

    def alloc_host_pages(self, n_pages: int) -> torch.Tensor | None:
        return self.host_evictor.alloc(n_pages)

    def alloc_pool_host_pages(self, pool: str, count: int) -> torch.Tensor | None:
        return self.host_evictor.alloc_pool(pool, count)

    def copy_to_host(
        self, device_slots: torch.Tensor, host_pages: torch.Tensor, owner: str | None = None
    ) -> GroupTransfer:
        return self.backups.copies.write(device_slots, host_pages, owner=owner)

    def backup_now(self, node: TreeNode) -> bool:
        if node.host_value is None:
            return self.backups.backup(node, evicting=True) and node.host_value is not None
        for entry in self.backups.in_flight:
            if entry.node is node:
                entry.transfer.synchronize()
        return True

    def evict_host(self, num_tokens: int) -> int:
        return self.host_evictor.evict(num_tokens)

    @property
    def l3_enabled(self) -> bool:
        return self.storage.enabled

    @property
    def l3_backend(self) -> StorageBackend | None:
        return self.storage.backend

    def wrap_l3_backend(self, wrap: Callable[[StorageBackend], StorageBackend]) -> bool:
        backend = self.storage.backend
        if backend is None:
            return False
        self.storage.backend = wrap(backend)
        return True

    @property
    def page_formats(self) -> Mapping[str, StorageFormat]:
        return self.controller.bundler.formats

    @property
    def l3_read_bytes_per_s(self) -> float | None:
        return self.storage.read_bytes_per_s

    @property
    def l3_queued_pages(self) -> int:
        return self.storage.queued_pages

    @property
    def page_bytes(self) -> int:
        return self.controller.page_bytes

    async def wait_for_activity(self, timeout_s: float) -> None:
        await self.storage.wait_for_activity(timeout_s)

    async def attach_l3(self, url: str) -> None:
        await self.controller.attach_l3(url)
