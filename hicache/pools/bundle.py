"""A page of every pool, stored and loaded as one bundle: one object per page per pool.

A model with several kinds of cached state (KV plus a DSA indexer, SWA, Mamba state) stores,
for each token page, one object per pool that holds data there, under keys that differ only in
their format digest (the pool name is part of it). They are written in one ``put`` batch and read
in one ``get_into`` batch; a page counts as loaded only when every object it needs arrived and
decoded, and loading stops at the first page that did not: an L3 hit is a prefix.

Payloads move between storage and host memory without a staging copy when the host pool's
layout keeps a page contiguous (the page_first family): the codec's header goes to a small
buffer and the payload straight into, or out of, the host page. A ``layer_first`` page is
copied through one contiguous buffer, in its stored order (that of ``page_first_direct``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache.backends.base import StorageBackend
from hicache.codec import HEADER_SIZE, NO_PARENT, PageMeta, decode_into, encode_page
from hicache.errors import CodecError, InvalidArgumentError
from hicache.keys import StorageFormat, storage_key
from hicache.layouts import Layout, page_shape, storage_layout
from hicache.pools.host import HostPool

__all__ = ["BundlePage", "PageBundler"]


@dataclass(frozen=True, slots=True)
class BundlePage:
    """One token page of a chain and the host pages holding it, per pool.

    ``host_pages`` names only the pools that hold this page (a state pool holds a snapshot at
    some page ends only). ``parent_hash`` is ``NO_PARENT`` for the first page of a chain.
    """

    namespace: bytes
    page_hash: bytes
    host_pages: Mapping[str, int]
    page_index: int = 0
    parent_hash: bytes = NO_PARENT


class PageBundler:
    """Keys, encoding and decoding of bundles for one model on one tensor-parallel shard."""

    def __init__(
        self,
        model_id: str,
        host_pools: Mapping[str, HostPool],
        shard: str = "tp0of1",
        compress: bool = False,
    ) -> None:
        if not host_pools:
            raise InvalidArgumentError("a bundle needs at least one host pool")
        self.host_pools = dict(host_pools)
        self.compress = compress
        self.formats: dict[str, StorageFormat] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, pool in self.host_pools.items():
            spec = pool.spec
            self.formats[name] = StorageFormat(
                model_id,
                spec.layout.dtype,
                storage_layout(pool.layout),
                spec.page_size,
                pool=name,
                # Replicated pools (MLA latent, DSA indexer) are one object for all ranks.
                shard="replicated" if spec.replicated_across_tp else shard,
            )
            self._shapes[name] = page_shape(spec.layout, pool.layout)
        self.counters = {"pages_written": 0, "pages_loaded": 0, "missing": 0, "corrupt": 0}

    def keys(self, page: BundlePage) -> dict[str, str]:
        """The storage key of each object of ``page``, by pool."""
        self._check(page)
        return {
            name: storage_key(page.namespace, self.formats[name], page.page_hash)
            for name in page.host_pages
        }

    def meta(self, name: str, page: BundlePage) -> PageMeta:
        pool = self.host_pools[name]
        return PageMeta(
            name,
            pool.spec.layout.dtype,
            self._shapes[name],
            storage_layout(pool.layout),
            page.page_index,
            page.parent_hash,
        )

    async def write(self, backend: StorageBackend, pages: Sequence[BundlePage]) -> list[bool]:
        """Store every object of every page in one batch; per page, whether all of it landed."""
        keys, values, owners = [], [], []
        for i, page in enumerate(pages):
            for name, key in self.keys(page).items():
                payload = self._payload(name, page.host_pages[name])
                keys.append(key)
                values.append(encode_page(key, payload, self.meta(name, page), self.compress))
                owners.append(i)
        stored = await backend.put(keys, values) if keys else []
        ok = [True] * len(pages)
        for i, landed in zip(owners, stored, strict=True):
            ok[i] = ok[i] and landed
        self.counters["pages_written"] += sum(ok)
        return ok

    async def read(self, backend: StorageBackend, pages: Sequence[BundlePage]) -> int:
        """Load pages into their host pages; how many leading pages arrived whole and checked.

        Pages after the first incomplete one are not used (their host pages hold unspecified
        bytes: the caller frees them). Missing and bad objects are counted, never raised.
        """
        plan = [(i, name, key) for i, p in enumerate(pages) for name, key in self.keys(p).items()]
        headers = [bytearray(HEADER_SIZE) for _ in plan]
        targets = [self._target(name, pages[i].host_pages[name]) for i, name, _ in plan]
        got = await backend.get_into(
            [key for _, _, key in plan], [[h, t] for h, t in zip(headers, targets, strict=True)]
        )
        bad_page = len(pages)
        for (i, name, key), header, target, n in zip(plan, headers, targets, got, strict=True):
            if i >= bad_page:
                continue
            if not self._decode(key, header, target, n, self.meta(name, pages[i])):
                bad_page = i
                continue
            if self.host_pools[name].layout is Layout.LAYER_FIRST:
                self.host_pools[name].write_page(
                    pages[i].host_pages[name], torch.from_numpy(target)
                )
        self.counters["pages_loaded"] += bad_page
        return bad_page

    def _decode(self, key: str, header: bytearray, target: object, n: int, meta: PageMeta) -> bool:
        if n < 0:
            self.counters["missing"] += 1
            return False
        try:
            decode_into(key, header, target, n, expect=meta)
        except (CodecError, InvalidArgumentError):
            self.counters["corrupt"] += 1
            return False
        return True

    def _payload(self, name: str, host_page: int) -> memoryview:
        pool = self.host_pools[name]
        data = pool.read_page(host_page) if pool.layout is Layout.LAYER_FIRST else None
        tensor = data if data is not None else pool.page_buffer(host_page)
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy().data)

    def _target(self, name: str, host_page: int) -> np.ndarray:
        """Where a page's payload is read to: the host page itself, or a scratch copy."""
        pool = self.host_pools[name]
        if pool.layout is Layout.LAYER_FIRST:
            return np.empty(pool.spec.page_bytes, dtype=np.uint8)
        return pool.page_buffer(host_page).reshape(-1).view(torch.uint8).numpy()

    def _check(self, page: BundlePage) -> None:
        unknown = set(page.host_pages) - set(self.host_pools)
        if unknown:
            raise InvalidArgumentError(f"no host pool named {sorted(unknown)} in this bundle")
        if not page.host_pages:
            raise InvalidArgumentError("a bundle page names no pool")
