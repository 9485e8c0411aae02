"""Removing a namespace's pages from L3: what a cache whose namespace no later run can name
(``StorageConfig.discard_on_close``) does when it closes, instead of leaving them behind.

Every storage key starts with its namespace's tag (:func:`~hicache.keys.namespace_tag`), so the
pages are found by a prefix listing. A backend that cannot list keeps them: nothing reads them
again, and they stay until the store itself evicts them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from hicache.backends.base import StorageBackend
from hicache.errors import HiCacheError

__all__ = ["discard_namespaces"]

logger = logging.getLogger(__name__)

_DELETE_BATCH = 512  # keys per delete call: few round trips, no request too large


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
