"""HiCacheController: moves pages between the device, host memory and L3.

Device <-> host copies run per layer through the layouts' gather/scatter on one
:class:`~hicache.layouts.TransferStream` per direction (CUDA streams with an event per layer;
synchronous copies on the CPU, behind the same API), so a forward pass waits for layer ``i`` of a
load only. Host <-> L3 goes through :class:`~hicache.tiering.l3.storage_tier.StorageTier` on
asyncio tasks.

The controller moves data and counts it; which pages move, and when, is the tree's business
(:class:`~hicache.tiering.cache.HiRadixCache`). Pools move in *groups*: a slot owner and the
sidecars that share its slots (the anchor with the DSA indexer; the conv state with the SSM state)
move together. The anchor's group is the default; a pool with slots of its own (an SWA window
pool, a state pool) is named by its owner in :meth:`HiCacheController.write` and ``load``.

Closing a cache whose namespaces no later run can name (``StorageConfig.discard_on_close``)
removes their pages from L3 (:func:`discard_namespaces`) instead of leaving them behind. Every
storage key starts with its namespace's tag (:func:`~hicache.keys.namespace_tag`), so the pages
are found by a prefix listing; a backend that cannot list keeps them: nothing reads them again,
and they stay until the store itself evicts them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch

from hicache.backends.base import StorageBackend
from hicache.errors import BackendError, ConfigError, HiCacheError, InvalidArgumentError
from hicache.layouts import TransferStream
from hicache.pools.device import DevicePool
from hicache.pools.host import HostPool
from hicache.tiering.common.config import HiCacheConfig, check_config
from hicache.tiering.common.metrics import HiCacheMetrics
from hicache.tiering.common.parts import GroupTransfer
from hicache.tiering.l3.bundler import PageBundler
from hicache.tiering.l3.storage_tier import StorageTier
from hicache.urls import redact_url, scrub

__all__ = ["HiCacheController", "discard_namespaces", "storage_tier"]

logger = logging.getLogger(__name__)

_DELETE_BATCH = 512  # keys per delete call: few round trips, no request too large


def storage_tier(
    config: HiCacheConfig, host_pools: Mapping[str, HostPool], metrics: HiCacheMetrics
) -> StorageTier:
    """The host <-> L3 path over ``host_pools``: their bundler and a storage tier, not started
    (:meth:`StorageTier.start` gives it a backend). Each controller builds its own; a
    benchmark of the path alone builds one without a cache."""
    storage = config.storage
    bundler = PageBundler(storage.model_id, host_pools, storage.shard, storage.compress, metrics)
    return StorageTier(storage, config.prefetch, bundler, metrics)


class HiCacheController:
    """The data mover of one pool group; open with :meth:`open`, close with :meth:`close`."""

    def __init__(
        self,
        config: HiCacheConfig,
        device_pools: Mapping[str, DevicePool],
        host_pools: Mapping[str, HostPool],
        metrics: HiCacheMetrics | None = None,
    ) -> None:
        if set(device_pools) != set(host_pools) or not device_pools:
            raise ConfigError("the controller needs a host pool for every device pool")
        self.config = config
        self.device_pools = dict(device_pools)
        self.host_pools = dict(host_pools)
        owners = [n for n, p in self.host_pools.items() if p.spec.shares_slots_with is None]
        self.anchor = owners[0]
        # Owner -> the pools its slots address (itself first), moved together.
        self.groups: dict[str, list[str]] = {name: [name] for name in owners}
        for name, pool in self.host_pools.items():
            if pool.spec.shares_slots_with is not None:
                self.groups[pool.spec.shares_slots_with].append(name)
        self.page_size = self.host_pools[self.anchor].page_size
        check_config(config, self.page_size)
        self.metrics = metrics or HiCacheMetrics()
        device = next(iter(self.device_pools.values())).device
        self._d2h = TransferStream(device)
        self._h2d = TransferStream(device)
        # Bytes of one token page of the anchor's group (what a token costs in every tier).
        self.page_bytes = self.group_page_bytes(self.anchor)
        self.storage = storage_tier(config, self.host_pools, self.metrics)
        self.bundler = self.storage.bundler
        self.metrics.gauge("l3_enabled", lambda: float(self.storage.enabled))

    def group_page_bytes(self, owner: str) -> int:
        """Bytes of one page (a snapshot, for a state pool) of ``owner``'s group."""
        return sum(self.host_pools[name].spec.page_bytes for name in self.groups[owner])

    @property
    def anchor_host(self) -> HostPool:
        return self.host_pools[self.anchor]

    @property
    def anchor_device(self) -> DevicePool:
        return self.device_pools[self.anchor]

    # ----- lifecycle ------------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        config: HiCacheConfig,
        device_pools: Mapping[str, DevicePool],
        host_pools: Mapping[str, HostPool],
        metrics: HiCacheMetrics | None = None,
    ) -> HiCacheController:
        """A controller with its L3 backend connected (when ``config.storage.url`` is set).

        An unreachable L3 is refused when ``storage.required``; otherwise the controller runs
        with L3 off, logs an error and counts ``l3_unavailable``.
        """
        controller = cls(config, device_pools, host_pools, metrics)
        url = config.storage.url
        if url is not None:
            backend = await controller._connect(url)
            if backend is not None:
                controller.storage.start(backend)
        return controller

    async def _open_url(self, url: str) -> StorageBackend:
        if self.config.storage.backend_in_thread:
            from hicache.backends.wrappers import ThreadedBackend

            return await ThreadedBackend.open_url(url)
        from hicache.backends.registry import open_backend

        return await open_backend(url)

    async def _connect(self, url: str) -> StorageBackend | None:
        try:
            return await self._open_url(url)
        except (BackendError, ConfigError, OSError) as exc:
            # The URL and the error are shown with the URL's credentials redacted.
            shown, why = redact_url(url), scrub(str(exc), url)
            if self.config.storage.required:
                raise BackendError(
                    f"L3 {shown!r} is required (storage.required) but could not be opened: {why}"
                ) from None
            self.metrics.add("l3_unavailable")
            logger.error(
                "L3 %r could not be opened (%s); RUNNING WITH L3 OFF. Set storage.required "
                "to refuse to start instead.",
                shown,
                why,
            )
            return None

    async def attach_l3(self, url: str) -> None:
        """Start writing to and prefetching from the L3 at ``url`` (at run time); raises what
        opening it raised, and InvalidArgumentError when one is attached already."""
        if self.storage.backend is not None:
            raise InvalidArgumentError("an L3 is attached already: detach it first")
        self.storage.start(await self._open_url(url))

    async def close(self, drain_s: float = 0.0, discard: Collection[str] = ()) -> None:
        """Stop the L3 tasks (after up to ``drain_s`` for queued writes to land) and close L3.

        ``discard``: namespace tags whose objects are deleted from L3 once its tasks have
        stopped (no write can land after); queued writes are then dropped, not drained.
        """
        backend = self.storage.backend
        drain_s = 0.0 if discard else drain_s
        if drain_s > 0 and backend is not None and not await self.storage.drain(drain_s):
            logger.warning("closing L3 with writes still queued after %.1f s", drain_s)
        await self.storage.stop()
        if backend is not None:
            self.metrics.add("l3_discarded_objects", await discard_namespaces(backend, discard))
            try:
                await backend.close()
            except HiCacheError as exc:  # closing a broken connection must not hide the rest
                logger.warning("closing L3 failed: %s", exc)

    # ----- device <-> host ------------------------------------------------------------------
    def write(
        self, device_slots: torch.Tensor, host_pages: torch.Tensor, owner: str | None = None
    ) -> GroupTransfer:
        """Back up device slots (whole pages) into host pages, every pool of ``owner``'s group
        (default: the anchor's)."""
        group = self.groups[owner or self.anchor]
        transfers = {
            name: self.host_pools[name].backup(
                self.device_pools[name], device_slots, host_pages, stream=self._d2h
            )
            for name in group
        }
        self.metrics.add("bytes_device_to_host", len(host_pages) * self.group_page_bytes(group[0]))
        return GroupTransfer(transfers)

    def load(
        self, host_pages: torch.Tensor, device_slots: torch.Tensor, owner: str | None = None
    ) -> GroupTransfer:
        """Load host pages into device slots, every pool of ``owner``'s group; wait per layer."""
        group = self.groups[owner or self.anchor]
        transfers = {
            name: self.host_pools[name].load(
                host_pages, self.device_pools[name], device_slots, stream=self._h2d
            )
            for name in group
        }
        self.metrics.add("bytes_host_to_device", len(host_pages) * self.group_page_bytes(group[0]))
        return GroupTransfer(transfers)

    def stats(self) -> dict[str, Any]:
        return self.metrics.as_dict()


async def discard_namespaces(backend: StorageBackend, tags: Collection[str]) -> int:
    """Delete every object of ``backend`` whose key is in one of the namespaces ``tags`` names;
    how many were deleted. Never raises for the store's sake: a failure is logged and what was
    deleted so far is counted (closing a cache must not fail because its L3 did)."""
    if not tags:
        return 0
    if not backend.capabilities.listable:
        logger.warning(
            "L3 backend %s cannot list its keys: the pages of %d discarded namespace(s) stay "
            "until the store evicts them",
            backend.name,
            len(tags),
        )
        return 0
    removed = 0
    try:
        for tag in sorted(tags):
            keys = [info.key async for info in backend.scan(f"{tag}-")]
            for lo in range(0, len(keys), _DELETE_BATCH):
                removed += sum(await backend.delete(keys[lo : lo + _DELETE_BATCH]))
    except HiCacheError as exc:
        logger.warning("discarding L3 pages failed after %d objects: %s", removed, exc)
    return removed
