"""A page of every pool, stored and loaded as one bundle: one object per page per pool.

A page's identity is its chained hash (:class:`PageHasher`): a node's page hashes continue the
chain of its parent, the first page of a namespace seeded by the namespace digest, so the keys
of a prefix are the same whichever node boundaries the tree happens to have, in this process or
the next one. Hashes are computed once per node and cut with it when the tree splits it.

A model with several kinds of cached state (KV plus a DSA indexer, SWA, Mamba state) stores,
for each token page, one object per pool that holds data there, under keys that differ only in
their format digest (the pool name is part of it). They are written in one ``put`` batch and read
in one ``get_into`` batch; a page counts as loaded only when every object it needs arrived and
decoded, and loading stops at the first page that did not: an L3 hit is a prefix.

Payloads move between storage and host memory without a staging copy when the host pool's
layout keeps a page contiguous (the page_first family): an object is two segments, its codec
header in a header arena (one 160-byte slot per host page, so the slot is as private to a
transfer as the page is) and its payload in the host page itself. Both lie in memory the
bundler can name (:meth:`PageBundler.registrable_memory`), so a backend that moves data by
address registers them once and moves pages without staging. A ``layer_first`` page is copied
through one contiguous buffer, in its stored order (that of ``page_first_direct``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache.backends.base import StorageBackend
from hicache.codec import (
    HEADER_SIZE,
    NO_PARENT,
    PageMeta,
    check_into,
    encode_page,
    meta_at,
    payload_checked_by,
)
from hicache.errors import (
    CodecError,
    InvalidArgumentError,
    PageKindMismatchError,
    UnsupportedVersionError,
)
from hicache.keys import (
    RadixKey,
    StorageFormat,
    chain_packed_hashes,
    chain_page_hashes,
    namespace_digest,
    namespace_tag,
    storage_key,
)
from hicache.layouts import Layout, page_shape, storage_layout
from hicache.pools.host import HostPool
from hicache.radix.node import TreeNode
from hicache.tiering.common.metrics import HiCacheMetrics

__all__ = ["BundlePage", "Namespace", "ObjectCheck", "PageBundler", "PageHasher"]


class ObjectCheck(enum.Enum):
    """What reading one object gave."""

    OK = "ok"
    MISSING = "missing"
    OTHER_KIND = "other_kind"  # intact, but not this reader's kind of page
    DAMAGED = "damaged"  # corrupt, truncated, or not a page of this key


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


Namespace = tuple[str | None, bool]  # (extra_key, is_bigram): one subtree of the tree


class PageHasher:
    """Page hashes and bundle pages of nodes, for one model (``model_id``) and page size."""

    def __init__(self, model_id: str, page_size: int, pool_names: list[str]) -> None:
        self.model_id = model_id
        self.page_size = page_size
        self.pool_names = list(pool_names)
        self._seeds: dict[Namespace, bytes] = {}

    def namespace_seed(self, namespace: Namespace) -> bytes:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = namespace_digest(self.model_id, *namespace)
        return seed

    def namespace_tags(self) -> frozenset[str]:
        """The key tags (:func:`~hicache.keys.namespace_tag`) of every namespace this hasher
        has seeded a chain in: every key it made starts with one of them."""
        return frozenset(namespace_tag(seed) for seed in self._seeds.values())

    def node_hashes(self, node: TreeNode) -> list[bytes]:
        """The chained page hashes of ``node`` (computed once, kept through splits)."""
        missing: list[TreeNode] = []
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None and walk.hash_value is None:
            missing.append(walk)
            walk = walk.parent
        for n in reversed(missing):
            assert n.parent is not None
            seed = self.last_hash(n.parent, n.namespace)
            page_bytes = self.page_size * (8 if n.namespace[1] else 4)
            n.hash_value = chain_packed_hashes(n.key, page_bytes, seed)
        assert node.hash_value is not None
        return node.hash_value

    def last_hash(self, node: TreeNode, namespace: Namespace) -> bytes:
        """The hash the chain continues from below ``node`` (the seed below a root)."""
        if node.parent is None:
            return self.namespace_seed(namespace)
        return self.node_hashes(node)[-1]

    def node_bundle(self, node: TreeNode, per_page: list[dict[str, int]]) -> list[BundlePage]:
        """``node``'s pages as bundle pages: page ``i`` with the host pages ``per_page[i]``
        (by pool: the pools that hold it); a page no pool holds is left out."""
        hashes = self.node_hashes(node)
        assert node.parent is not None
        first = _depth_units(node) // self.page_size
        previous = self.last_hash(node.parent, node.namespace) if first else NO_PARENT
        seed = self.namespace_seed(node.namespace)
        parents = [previous, *hashes[:-1]]
        return [
            BundlePage(seed, h, pages, first + i, parent)
            for i, (pages, h, parent) in enumerate(zip(per_page, hashes, parents, strict=True))
            if pages
        ]

    def candidates(self, key: RadixKey, start: int, end: int, below: TreeNode) -> list[BundlePage]:
        """Bundle pages of ``key[start:end]`` (page-aligned), continuing the chain of ``below``;
        their host pages are -1 until a prefetch takes some."""
        namespace = (key.extra_key, key.is_bigram)
        seed = self.last_hash(below, namespace)
        hashes = chain_page_hashes(key.slice(start, end), self.page_size, seed)
        first = start // self.page_size
        parents = [seed if first else NO_PARENT, *hashes[:-1]]
        ns_seed = self.namespace_seed(namespace)
        return [
            BundlePage(ns_seed, h, dict.fromkeys(self.pool_names, -1), first + i, parent)
            for i, (h, parent) in enumerate(zip(hashes, parents, strict=True))
        ]


class PageBundler:
    """Keys, encoding and decoding of bundles for one model on one tensor-parallel shard."""

    def __init__(
        self,
        model_id: str,
        host_pools: Mapping[str, HostPool],
        shard: str = "tp0of1",
        compress: bool = False,
        metrics: HiCacheMetrics | None = None,
    ) -> None:
        if not host_pools:
            raise InvalidArgumentError("a bundle needs at least one host pool")
        self.host_pools = dict(host_pools)
        self.compress = compress
        self.formats: dict[str, StorageFormat] = {}
        self._templates: dict[str, PageMeta] = {}
        self._page_bytes: dict[str, np.ndarray | None] = {}
        self._headers: dict[str, np.ndarray | None] = {}  # header slot per host page
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
            arena = np.zeros((pool.num_pages, HEADER_SIZE), np.uint8) if contiguous else None
            self._headers[name] = arena
        # Pages that were missing or failed their checks on read, counted where they are seen.
        self.metrics = metrics or HiCacheMetrics()

    def registrable_memory(self) -> list[np.ndarray]:
        """The host memory that pages move from and to without a copy: each contiguous pool's
        pages and its header arena (for backends that take registered memory)."""
        buffers = [*self._page_bytes.values(), *self._headers.values()]
        return [b for b in buffers if b is not None]

    def keys(self, page: BundlePage) -> dict[str, str]:
        """The storage key of each object of ``page``, by pool."""
        self._check(page)
        return {
            name: storage_key(page.namespace, self.formats[name], page.page_hash)
            for name in page.host_pages
        }

    def bytes_of(self, page: BundlePage) -> int:
        """Payload bytes of ``page``'s objects (the pools that hold it)."""
        return sum(self.host_pools[name].spec.page_bytes for name in page.host_pages)

    def check_object(
        self, key: str, name: str, header: np.ndarray, payload: np.ndarray, n: int
    ) -> ObjectCheck:
        """What an object of pool ``name`` read into ``header`` and ``payload`` (``n`` bytes,
        negative when missing) is; missing and bad objects are counted as a read counts them."""
        return self._decode(key, header, payload, n, self._templates[name])

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
                host_page = page.host_pages[name]
                payload = self._payload(name, host_page)
                keys.append(key)
                segments = encode_page(key, payload, self._templates[name], self.compress, place)
                arena = self._headers[name]
                if arena is not None and len(segments) == 2:  # uncompressed: header, payload
                    arena[host_page] = np.frombuffer(segments[0], np.uint8)
                    segments[0] = memoryview(arena[host_page])
                values.append(segments)
                owners.append(i)
        stored = await backend.put(keys, values) if keys else []
        ok = [True] * len(pages)
        for i, landed in zip(owners, stored, strict=True):
            ok[i] = ok[i] and landed
        return ok

    async def read(
        self,
        backend: StorageBackend,
        pages: Sequence[BundlePage],
        keys_of: Sequence[Mapping[str, str]] | None = None,
        into: Sequence[int] | None = None,
        corrupt: list[str] | None = None,
    ) -> int:
        """Load pages into their host pages; how many leading pages arrived whole and checked.

        Pages after the first incomplete one are not used (their host pages hold unspecified
        bytes: the caller frees them), but the objects that arrived are still checked, so that
        every bad object of the batch is found. Missing and bad objects are counted, never
        raised; the keys of bad and missing ones (the caller reads what L3 listed, so a missing
        one is a copy L3 could not deliver) are appended to ``corrupt`` when it is given.
        ``into``: the host page of each page for every pool (pools sharing one page index),
        instead of each page's ``host_pages``.
        """
        keys_of = keys_of or [self.keys(p) for p in pages]
        plan = [(i, name, key) for i, ks in enumerate(keys_of) for name, key in ks.items()]

        def host_page(i: int, name: str) -> int:
            return into[i] if into is not None else pages[i].host_pages[name]

        headers = [self._header_slot(name, host_page(i, name)) for i, name, _ in plan]

        targets = [self._target(name, host_page(i, name)) for i, name, _ in plan]
        got = await backend.get_into(
            [key for _, _, key in plan], [[h, t] for h, t in zip(headers, targets, strict=True)]
        )
        bad_page = len(pages)
        for (i, name, key), header, target, n in zip(plan, headers, targets, got, strict=True):
            if i >= bad_page and n < 0:
                if corrupt is not None:  # listed by L3, not delivered: see below
                    corrupt.append(key)
                continue  # a missing object after the hit ended: nobody needs it
            checked = payload_checked_by(backend.capabilities.checks_pages_over, n)
            outcome = self._decode(key, header, target, n, self._templates[name], checked)
            if outcome is not ObjectCheck.OK:
                bad_page = min(bad_page, i)
                # Missing too: the caller reads only pages L3 listed, so a miss here is a
                # copy it could not deliver (a store that checks its own records, disk://,
                # reports a damaged one so), to be rewritten as a repair.
                unusable = outcome in (ObjectCheck.DAMAGED, ObjectCheck.MISSING)
                if unusable and corrupt is not None:
                    corrupt.append(key)
                continue
            if i >= bad_page:
                continue
            if self.host_pools[name].layout is Layout.LAYER_FIRST:
                self.host_pools[name].write_page(host_page(i, name), torch.from_numpy(target))
        return bad_page

    def _header_slot(self, name: str, host_page: int) -> np.ndarray | bytearray:
        arena = self._headers[name]
        if arena is None:
            return bytearray(HEADER_SIZE)
        return arena[self._checked_page(name, host_page)]  # type: ignore[no-any-return]

    def _decode(
        self,
        key: str,
        header: np.ndarray | bytearray,
        target: object,
        n: int,
        meta: PageMeta,
        payload_checked: bool = False,
    ) -> ObjectCheck:
        if n < 0:
            self.metrics.add("missing_pages")
            return ObjectCheck.MISSING
        try:
            check_into(key, header, target, n, meta, payload_checked)
        except (PageKindMismatchError, UnsupportedVersionError):
            # Intact, but another configuration's page or a newer writer's: a miss for this
            # reader, and not ours to delete.
            self.metrics.add("corrupt_pages")
            return ObjectCheck.OTHER_KIND
        except (CodecError, InvalidArgumentError):
            self.metrics.add("corrupt_pages")
            return ObjectCheck.DAMAGED
        return ObjectCheck.OK

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


def _depth_units(node: TreeNode) -> int:
    """Units (tokens, or bigram pairs) between the namespace root and ``node``'s first one."""
    units, walk = 0, node.parent
    while walk is not None:
        units += walk.length
        walk = walk.parent
    return units
