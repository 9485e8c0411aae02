"""Fill and damage stores for the operating tools' tests: pages written through the real write
path (chains with parent hashes, :func:`hicache.tools.bench.stores.store_tools.write_chain`), then
damaged on purpose. A plain module (not conftest) so that test modules can import it by name."""

from __future__ import annotations

import errno
import os
import pathlib
import random
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import xxhash

from hicache.backends.base import StorageBackend
from hicache.codec import decode_page
from hicache.errors import CodecError
from hicache.keys import PageKeyScheme, RadixKey
from hicache.tools.bench.stores.store_tools import page_scheme, write_chain

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

    def link_out(self, key: str, outside: pathlib.Path) -> pathlib.Path:
        """The attack on a file store: ``key``'s second-level fan-out directory becomes a
        symbolic link to ``outside``, where a victim file named like the key (not a page)
        waits; the victim's path."""
        directory = self.path(key).parent
        shutil.rmtree(directory)
        directory.symlink_to(outside)
        victim = outside / key
        victim.write_bytes(b"outside the store, not a page: " + key.encode())
        return victim

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


def snapshot(directory: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    """Every entry below ``directory`` (links not followed): bytes and mtime (ns) by path."""
    out: dict[str, tuple[bytes, int]] = {}
    for path in sorted(directory.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        out[str(path.relative_to(directory))] = (data, st.st_mtime_ns)
    return out


class WriteGuard:
    """Makes the directory tree ``root`` read-only for this process, and records every try.

    Tests run as root here, and root ignores permission bits, so a directory cannot be made
    read-only for them; a read-only bind mount or ``chattr +i`` is not available either. So the
    store is made read-only at the system-call boundary instead: each ``os`` function that
    writes raises ``EROFS`` (what a read-only mount answers) when its target lies under
    ``root`` (a ``dir_fd`` or a descriptor is resolved through ``/proc/self/fd``), and notes
    what it was asked. Calls elsewhere (pytest's own files, other tests' threads) go through.
    """

    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    _WRITERS = (
        "mkdir", "unlink", "remove", "rmdir", "rename", "replace", "utime", "truncate",
        "ftruncate", "symlink", "link", "chmod",
    )  # fmt: skip

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: pathlib.Path) -> None:
        self.root = os.path.realpath(root)
        self.attempts: list[str] = []
        real_open = os.open

        def guarded_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & self._WRITE_FLAGS:
                self._check("open", path, kwargs.get("dir_fd"))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", guarded_open)
        for name in self._WRITERS:
            monkeypatch.setattr(os, name, self._guarded(name, getattr(os, name)))

    def _guarded(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._check(name, args[0], kwargs.get("dir_fd", kwargs.get("src_dir_fd")))
            if name in ("rename", "replace", "link", "symlink"):
                self._check(name, args[1], kwargs.get("dir_fd", kwargs.get("dst_dir_fd")))
            return real(*args, **kwargs)

        return call

    def _check(self, name: str, path: Any, dir_fd: int | None) -> None:
        if isinstance(path, int):  # a descriptor: ftruncate, utime
            where = os.readlink(f"/proc/self/fd/{path}")
        else:
            where = os.fsdecode(path)
            if dir_fd is not None and not os.path.isabs(where):
                where = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), where)
        where = os.path.abspath(where)
        if where == self.root or where.startswith(self.root + os.sep):
            self.attempts.append(f"{name} {where}")
            raise OSError(errno.EROFS, "Read-only file system (test guard)", where)
