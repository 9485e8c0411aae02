"""Repairing L3: keys whose stored object failed its checks are suspects until rewritten.

A prefetch that reads a corrupt, truncated or foreign object counts it as a miss, deletes it
(best effort) and adds its key here. A write of a suspect key does not trust ``exists`` (the
delete may have failed, or another process may have written the same bad bytes back) and
writes the page again; a write that lands clears the suspicion. So a damaged page stays a miss
only until some request recomputes it, instead of cutting every prefix through it for good.

A page the engine computed although ``exists`` says L3 holds it was never read (its prefetch
was under the threshold, ended at an earlier bad page, or was skipped): the writer reads such
copies back and checks them (:class:`CopyChecker`, into memory a backend can register) before
skipping them, so a bad copy is rewritten and a good one is left alone.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from hicache.backends.base import StorageBackend
from hicache.codec import HEADER_SIZE
from hicache.tiering.l3.bundler import ObjectCheck, PageBundler

__all__ = ["CopyChecker", "SuspectKeys"]


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


class CopyChecker:
    """Reads stored copies whole into scratch pages of its own and checks them.

    The scratch pages are memory a backend can register (:meth:`memory`), as the host pools
    are, so a backend that moves data by address reads them without staging. They hold a few
    pages of every pool (about ``budget_bytes`` in all, at least one page), and one check uses
    them at a time.
    """

    def __init__(self, bundler: PageBundler, budget_bytes: int = 8 << 20) -> None:
        self._bundler = bundler
        sizes = {name: pool.spec.page_bytes for name, pool in bundler.host_pools.items()}
        self.slots = max(1, min(32, budget_bytes // sum(HEADER_SIZE + n for n in sizes.values())))
        self._payloads = {name: np.zeros((self.slots, n), np.uint8) for name, n in sizes.items()}
        self._headers = {name: np.zeros((self.slots, HEADER_SIZE), np.uint8) for name in sizes}
        self._turn = asyncio.Lock()

    def memory(self) -> list[np.ndarray]:
        return [*self._payloads.values(), *self._headers.values()]

    async def unusable(
        self, backend: StorageBackend, keys: Sequence[Mapping[str, str]]
    ) -> tuple[list[str], list[str]]:
        """Of the objects of ``keys`` (each page's keys by pool): those damaged (corrupt,
        truncated, padded, another key's page) and those gone. An intact page of another
        configuration or of a newer writer is neither: it is not ours to overwrite."""
        damaged: list[str] = []
        gone: list[str] = []
        async with self._turn:  # a late call holds the scratch pages until it returns
            for lo in range(0, len(keys), self.slots):
                plan = [
                    (slot, name, key)
                    for slot, page in enumerate(keys[lo : lo + self.slots])
                    for name, key in page.items()
                ]
                segments = [[self._headers[n][s], self._payloads[n][s]] for s, n, _ in plan]
                got = await backend.get_into([key for _, _, key in plan], segments)
                for (_, name, key), (header, payload), n in zip(plan, segments, got, strict=True):
                    outcome = self._bundler.check_object(key, name, header, payload, n)
                    if outcome is ObjectCheck.DAMAGED:
                        damaged.append(key)
                    elif outcome is ObjectCheck.MISSING:
                        gone.append(key)
        return damaged, gone
