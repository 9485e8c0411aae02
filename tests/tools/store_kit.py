"""Fill and damage stores for the operating tools' tests: pages written through the real write
path (chains with parent hashes, :func:`hicache.tools.bench_tools.write_chain`), then damaged on
purpose. A plain module (not conftest) so that test modules can import it by name."""

from __future__ import annotations

import os
import pathlib
import random
import struct
import time
from collections.abc import Sequence

import xxhash

from hicache.backends.base import StorageBackend
from hicache.codec import decode_page
from hicache.errors import CodecError
from hicache.keys import PageKeyScheme, RadixKey
from hicache.tools.bench_tools import page_scheme, write_chain

PAGE_TOKENS = 16  # page_scheme()'s page size


class StoreKit:
    """A store plus the ways to fill and damage it that the tests need."""

    def __init__(self, backend: StorageBackend, root: pathlib.Path | None) -> None:
        self.backend = backend
        self.root = root
        self.schemes: dict[str, PageKeyScheme] = {}
        self.rng = random.Random(11)

    async def chain(
        self,
        pages: int,
        tenant: str | None = None,
        pool: str = "kv",
        compress: bool = False,
        payload_bytes: int = 512,
    ) -> list[str]:
        """Write one chain of ``pages`` pages; its storage keys in chain order."""
        scheme = self.schemes.setdefault(pool, page_scheme(pool=pool))
        tokens = [self.rng.randrange(1 << 31) for _ in range(pages * PAGE_TOKENS)]
        if compress:  # small values: the byte planes shrink
            payloads = [bytes(self.rng.randrange(4) for _ in range(payload_bytes))] * pages
        else:
            payloads = [self.rng.randbytes(payload_bytes) for _ in range(pages)]
        return await write_chain(self.backend, scheme, RadixKey(tokens, tenant), payloads, compress)

    # ----- damage ---------------------------------------------------------------------------
    async def read(self, key: str) -> bytes:
        (data,) = await self.backend.get([key])
        assert data is not None, key
        return data

    async def replace(self, key: str, data: bytes) -> None:
        assert await self.backend.put([key], [data]) == [True]

    async def flip_bit(self, key: str, offset: int) -> None:
        data = bytearray(await self.read(key))
        data[offset] ^= 0x10
        await self.replace(key, bytes(data))

    async def truncate(self, key: str, keep: int) -> None:
        await self.replace(key, (await self.read(key))[:keep])

    async def copy_page(self, donor: str, key: str) -> None:
        """``key`` gets ``donor``'s bytes: a valid page, but written under another key."""
        await self.replace(key, await self.read(donor))

    async def newer_version(self, key: str) -> None:
        """A page as a newer writer would seal it: another version, its own header checksum
        (a version field changed without resealing is damage, not a newer format)."""
        data = bytearray(await self.read(key))
        struct.pack_into("<H", data, 4, 99)
        struct.pack_into("<Q", data, 152, xxhash.xxh3_64_intdigest(bytes(data[:152])))
        await self.replace(key, bytes(data))

    # ----- file-store only ------------------------------------------------------------------
    def path(self, key: str) -> pathlib.Path:
        assert self.root is not None
        h = xxhash.xxh3_64_hexdigest(key.encode())
        return self.root / h[0:2] / h[2:4] / key

    def age(self, keys: Sequence[str], seconds: float) -> None:
        """Make the objects look written ``seconds`` ago."""
        when = time.time() - seconds
        for key in keys:
            os.utime(self.path(key), (when, when))

    def temp_file(self, key: str, age_s: float, size: int = 100) -> pathlib.Path:
        """A temporary file as a writer that crashed (or is still writing) leaves it."""
        directory = self.path(key).parent
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.{self.rng.getrandbits(48):012x}.tmp"
        tmp.write_bytes(b"\0" * size)
        when = time.time() - age_s
        os.utime(tmp, (when, when))
        return tmp

    # ----- reading back ---------------------------------------------------------------------
    async def keys(self) -> set[str]:
        return {info.key async for info in self.backend.scan()}

    async def hits(self, chain: list[str]) -> int:
        """How many pages of a chain a serving loop gets: present from the start (leading
        hits), each read and decoded, up to the first that does not decode."""
        n = await self.backend.leading_hits(chain)
        for i, (key, data) in enumerate(zip(chain[:n], await self.backend.get(chain[:n]))):
            try:
                decode_page(key, data)
            except CodecError:
                return i
        return n
