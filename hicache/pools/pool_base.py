"""What device and host pools share: a spec, and an allocator owned or borrowed from an owner.

A pool whose spec names ``shares_slots_with`` is a sidecar: it has no allocator of its own but
uses its owner's, so one index addresses both, and allocating or freeing goes through the owner.
:class:`~hicache.pools.device.DevicePool` counts its allocator in token slots,
:class:`~hicache.pools.host.HostPool` in whole pages (its allocator's "slot" is a page); the
``_unit`` word each names in its errors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, TypeVar

from hicache.errors import InvalidArgumentError
from hicache.pools.allocator import TokenSlotAllocator
from hicache.pools.pool_spec import ModelPools, PoolSpec

__all__ = ["PoolBase", "build_pool_group"]


class PoolBase:
    """The spec and the allocator of one pool; the owner/sidecar wiring of the two."""

    _unit: ClassVar[str]  # what the allocator counts, as errors name it: "slot" or "page"
    spec: PoolSpec
    allocator: TokenSlotAllocator

    def _owned_or_shared_allocator(
        self, count: int, owner: PoolBase | None, allocator_page_size: int
    ) -> TokenSlotAllocator:
        """A new allocator of ``count`` units for an owner, the owner's own for a sidecar."""
        unit, shared = self._unit, self.spec.shares_slots_with
        if shared is None:
            if owner is not None:
                raise InvalidArgumentError(f"pool {self.spec.name!r} owns its {unit}s; no owner")
            return TokenSlotAllocator(count, allocator_page_size)
        if not isinstance(owner, type(self)) or owner.spec.name != shared:
            raise InvalidArgumentError(f"pool {self.spec.name!r} needs its {unit} owner {shared!r}")
        if owner.allocator.size != count:
            raise InvalidArgumentError(
                f"pool {self.spec.name!r} shares {owner.allocator.size} {unit}s with {shared!r}, "
                f"not {count}"
            )
        return owner.allocator

    @property
    def owns_slots(self) -> bool:
        return self.spec.shares_slots_with is None

    # -- sizes, in pages and in slots (tokens, or snapshots for a per-sequence pool) ---------

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def available_pages(self) -> int:
        """Free pages (shared with the owner for a sidecar pool)."""
        return self.allocator.available_size // self.allocator.page_size

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.available_pages

    @property
    def available_size(self) -> int:
        """Free slots (shared with the owner for a sidecar pool)."""
        return self.available_pages * self.page_size

    @property
    def used_size(self) -> int:
        return self.used_pages * self.page_size

    def _check_owner(self, what: str) -> None:
        """Refuse ``what`` (allocate, free) on a sidecar: it goes through the owner."""
        shared = self.spec.shares_slots_with
        if shared is not None:
            raise InvalidArgumentError(
                f"pool {self.spec.name!r} shares {self._unit}s with {shared!r}; {what} there"
            )


PoolT = TypeVar("PoolT", bound=PoolBase)


def build_pool_group(
    model: ModelPools,
    counts: Mapping[str, int],
    unit: str,
    make: Callable[[PoolSpec, int, PoolT | None], PoolT],
) -> dict[str, PoolT]:
    """A pool per pool of ``model``, in its order: ``make(spec, count, owner)``. ``counts`` sizes
    every owner; a sidecar is sized like its owner unless ``counts`` names it, and is made after
    it (owners first) so that ``make`` gets the owner to share with."""
    pools: dict[str, PoolT] = {}
    for spec in sorted(model, key=lambda s: s.shares_slots_with is not None):  # owners first
        if spec.shares_slots_with is None:
            if spec.name not in counts:
                raise InvalidArgumentError(f"no {unit} count for pool {spec.name!r}")
            pools[spec.name] = make(spec, counts[spec.name], None)
        else:
            owner = pools[spec.shares_slots_with]
            pools[spec.name] = make(spec, counts.get(spec.name, owner.allocator.size), owner)
    unknown = set(counts) - set(pools)
    if unknown:
        raise InvalidArgumentError(f"{unit} counts for unknown pools {sorted(unknown)}")
    return {name: pools[name] for name in model.names}
