"""Repairing L3: keys whose stored object failed its checks are suspects until rewritten.

A prefetch that reads a corrupt, truncated or foreign object counts it as a miss, deletes it
(best effort) and adds its key here. A write of a suspect key does not trust ``exists`` (the
delete may have failed, or another process may have written the same bad bytes back) and
writes the page again; a write that lands clears the suspicion. So a damaged page stays a miss
only until some request recomputes it, instead of cutting every prefix through it for good.

A page the engine computed although ``exists`` says L3 holds it was never read (its prefetch
was under the threshold, ended at an earlier bad page, or was skipped): the writer reads such
copies back and checks them (:func:`damaged_copies`) before skipping them, so a bad copy is
rewritten and a good one is left alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from hicache.backends.base import StorageBackend
from hicache.codec import verify_page
from hicache.errors import CodecError, InvalidArgumentError, UnsupportedVersionError

__all__ = ["SuspectKeys", "damaged_copies"]


class SuspectKeys:
    """A bounded set of keys, oldest forgotten first (a forgotten key costs one more miss)."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def discard(self, keys: Iterable[str]) -> int:
        """Forget ``keys``; how many of them were suspects."""
        known = [key for key in keys if key in self._keys]
        for key in known:
            del self._keys[key]
        return len(known)

    def vouched(self, keys: Sequence[str], found: Sequence[bool]) -> list[bool]:
        """``found`` (an ``exists`` answer for ``keys``), with every suspect key reported
        absent."""
        if not self._keys:
            return list(found)
        return [ok and key not in self._keys for key, ok in zip(keys, found, strict=True)]


async def damaged_copies(
    backend: StorageBackend, keys: Sequence[str], size_hint: int
) -> tuple[list[str], list[str]]:
    """Read the objects of ``keys`` whole and check each through the codec: the keys whose
    objects are damaged (corrupt, truncated, padded, foreign) and those that are gone.

    A newer writer's page (:class:`~hicache.errors.UnsupportedVersionError`) is neither: it is
    not ours to overwrite. ``size_hint``: the expected size of one object (header included).
    """
    damaged: list[str] = []
    gone: list[str] = []
    for key, data in zip(keys, await backend.get(keys, size_hint), strict=True):
        if data is None:
            gone.append(key)
            continue
        try:
            verify_page(key, data)
        except UnsupportedVersionError:
            continue
        except (CodecError, InvalidArgumentError):
            damaged.append(key)
    return damaged, gone
