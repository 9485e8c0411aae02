"""The store scanner underneath the tools: key parsing, opening, failures and early exit."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from hicache.backends.base import ObjectInfo, StorageBackend
from hicache.backends.wrappers import WrapperBackend
from hicache.errors import BackendError, BackendNotFoundError, BackendUnavailableError, ConfigError
from hicache.tools.store.scan import (
    ReadMode,
    ScanOptions,
    StoreScanner,
    open_store,
    parse_page_key,
)

if TYPE_CHECKING:
    from store_kit import StoreKit


def test_parse_page_key() -> None:
    key = f"{'a' * 16}-{'0123456789abcdef'}-{'e' * 64}"
    parts = parse_page_key(key)
    assert parts is not None and (parts.namespace, parts.fmt) == ("a" * 16, "0123456789abcdef")
    assert parts.parent_key(b"\x01" * 32) == f"{'a' * 16}-0123456789abcdef-{'01' * 32}"
    assert parts.parent_key(bytes(32)) is None
    for other in ("plugin-key", key.upper(), key + "0", key.replace("-", "_")):
        assert parse_page_key(other) is None


async def test_open_store(tmp_path: pathlib.Path) -> None:
    with pytest.raises(BackendNotFoundError):
        await open_store("nosuch://x")
    with pytest.raises(ConfigError, match="one process"):
        await open_store("memory://")
    with pytest.raises(BackendUnavailableError, match="no store"):
        await open_store(f"file://{tmp_path / 'absent'}")
    assert not (tmp_path / "absent").exists()
    (tmp_path / "there").mkdir()
    backend = await open_store(f"file://{tmp_path / 'there'}")
    assert backend.name == "file"
    await backend.close()


class _BrokenListing(WrapperBackend):
    def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        return self._fail_after(prefix, 5)

    async def _fail_after(self, prefix: str, n: int) -> AsyncIterator[ObjectInfo]:
        async for info in self.inner.scan(prefix):
            if n == 0:
                raise BackendError("listing failed")
            n -= 1
            yield info


@pytest.mark.parametrize("mode", list(ReadMode))
async def test_a_failed_listing_raises(memory_kit: StoreKit, mode: ReadMode) -> None:
    for _ in range(4):
        await memory_kit.chain(4)
    broken: StorageBackend = _BrokenListing(memory_kit.backend)
    with pytest.raises(BackendError, match="listing failed"):
        async for _ in StoreScanner(broken, ScanOptions(mode, batch_objects=2)):
            pass


async def test_leaving_early_cancels_what_is_in_flight(memory_kit: StoreKit) -> None:
    for _ in range(10):
        await memory_kit.chain(8)
    before = len(asyncio.all_tasks())
    scanner = StoreScanner(memory_kit.backend, ScanOptions(ReadMode.FULL, batch_objects=4))
    async with contextlib.aclosing(scanner.stream()) as objects:
        async for _ in objects:
            break
    assert len(asyncio.all_tasks()) == before
    assert 0 < scanner.objects < 80
