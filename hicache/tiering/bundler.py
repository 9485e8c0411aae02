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
from hicache.codec import HEADER_SIZE, NO_PARENT, PageMeta, check_into, encode_page, meta_at
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
        self._templates: dict[str, PageMeta] = {}
        self._page_bytes: dict[str, np.ndarray | None] = {}
        self._num_pages = {name: pool.num_pages for name, pool in self.host_pools.items()}
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
            shape = page_shape(spec.layout, pool.layout)
            self._templates[name] = PageMeta(
                name, spec.layout.dtype, shape, storage_layout(pool.layout)
            )
            # Each page's bytes as one numpy row, made once: a view per page costs ~0.3 us
            # this way instead of ~5 us through tensor views.
            contiguous = pool.layout is not Layout.LAYER_FIRST
            rows = pool.buffer.view(pool.num_pages, -1) if contiguous else None
            self._page_bytes[name] = rows.view(torch.uint8).numpy() if rows is not None else None
        self.counters = {"pages_written": 0, "pages_loaded": 0, "missing": 0, "corrupt": 0}

    def keys(self, page: BundlePage) -> dict[str, str]:
        """The storage key of each object of ``page``, by pool."""
        self._check(page)
        return {
            name: storage_key(page.namespace, self.formats[name], page.page_hash)
            for name in page.host_pages
        }

    def meta(self, name: str, page: BundlePage) -> PageMeta:
        return meta_at(self._templates[name], page.page_index, page.parent_hash)

    async def write(
        self,
        backend: StorageBackend,
        pages: Sequence[BundlePage],
        keys_of: Sequence[Mapping[str, str]] | None = None,
    ) -> list[bool]:
        """Store every object of every page in one batch; per page, whether all of it landed.

        ``keys_of``: each page's :meth:`keys`, when the caller has them already.
        """
        keys, values, owners = [], [], []
        for i, page in enumerate(pages):
            place = (page.page_index, page.parent_hash)
            for name, key in (keys_of[i] if keys_of else self.keys(page)).items():
                payload = self._payload(name, page.host_pages[name])
                keys.append(key)
                meta = self._templates[name]
                values.append(encode_page(key, payload, meta, self.compress, place))
                owners.append(i)
        stored = await backend.put(keys, values) if keys else []
        ok = [True] * len(pages)
        for i, landed in zip(owners, stored, strict=True):
            ok[i] = ok[i] and landed
        self.counters["pages_written"] += sum(ok)
        return ok

    async def read(
        self,
        backend: StorageBackend,
        pages: Sequence[BundlePage],
        keys_of: Sequence[Mapping[str, str]] | None = None,
        into: Sequence[int] | None = None,
    ) -> int:
        """Load pages into their host pages; how many leading pages arrived whole and checked.

        Pages after the first incomplete one are not used (their host pages hold unspecified
        bytes: the caller frees them). Missing and bad objects are counted, never raised.
        ``into``: the host page of each page for every pool (pools sharing one page index),
        instead of each page's ``host_pages``.
        """
        keys_of = keys_of or [self.keys(p) for p in pages]
        plan = [(i, name, key) for i, ks in enumerate(keys_of) for name, key in ks.items()]
        headers = [bytearray(HEADER_SIZE) for _ in plan]

        def host_page(i: int, name: str) -> int:
            return into[i] if into is not None else pages[i].host_pages[name]

        targets = [self._target(name, host_page(i, name)) for i, name, _ in plan]
        got = await backend.get_into(
            [key for _, _, key in plan], [[h, t] for h, t in zip(headers, targets, strict=True)]
        )
        bad_page = len(pages)
        for (i, name, key), header, target, n in zip(plan, headers, targets, got, strict=True):
            if i >= bad_page:
                continue
            if not self._decode(key, header, target, n, self._templates[name]):
                bad_page = i
                continue
            if self.host_pools[name].layout is Layout.LAYER_FIRST:
                self.host_pools[name].write_page(host_page(i, name), torch.from_numpy(target))
        self.counters["pages_loaded"] += bad_page
        return bad_page

    def _decode(self, key: str, header: bytearray, target: object, n: int, meta: PageMeta) -> bool:
        if n < 0:
            self.counters["missing"] += 1
            return False
        try:
            check_into(key, header, target, n, meta)
        except (CodecError, InvalidArgumentError):
            self.counters["corrupt"] += 1
            return False
        return True

    def _payload(self, name: str, host_page: int) -> memoryview:
        rows = self._page_bytes[name]
        if rows is not None:
            return memoryview(rows[self._checked_page(name, host_page)])
        data = self.host_pools[name].read_page(host_page)
        return memoryview(data.reshape(-1).view(torch.uint8).numpy().data)

    def _target(self, name: str, host_page: int) -> np.ndarray:
        """Where a page's payload is read to: the host page itself, or a scratch copy."""
        rows = self._page_bytes[name]
        if rows is not None:
            return rows[self._checked_page(name, host_page)]  # type: ignore[no-any-return]
        return np.empty(self.host_pools[name].spec.page_bytes, dtype=np.uint8)

    def _checked_page(self, name: str, host_page: int) -> int:
        if not 0 <= host_page < self._num_pages[name] or isinstance(host_page, bool):
            raise InvalidArgumentError(f"host page {host_page!r} out of range for {name!r}")
        return host_page

    def _check(self, page: BundlePage) -> None:
        unknown = set(page.host_pages) - set(self.host_pools)
        if unknown:
            raise InvalidArgumentError(f"no host pool named {sorted(unknown)} in this bundle")
        if not page.host_pages:
            raise InvalidArgumentError("a bundle page names no pool")
