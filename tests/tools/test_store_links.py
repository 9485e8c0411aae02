"""The store tools never act through a symbolic link planted in a file store.

The attack: someone who can write inside the store replaces a fan-out directory by a link to
an outside directory holding a victim file named like a key. The listings skip links; a link
planted after the listing (a serving host's store changes while a tool runs) must still not
lead a delete, a recheck or a read outside the root.
"""

from __future__ import annotations

import io
import pathlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import pytest
from store_kit import StoreKit, snapshot

from hicache.backends.file import FileBackend
from hicache.codec import HEADER_SIZE
from hicache.tools.store.compact import CompactOptions, compact_store
from hicache.tools.store.inspect import InspectOptions, OutputFormat, inspect_store
from hicache.tools.store.verify import VerifyOptions, verify_store


@pytest.fixture
def outside(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "outside"
    path.mkdir()
    return path


def _then(listing: Callable[..., AsyncIterator[Any]], act: Callable[[], object]) -> Any:
    """``listing`` (scan or read_all), with ``act`` run once everything has been listed."""

    def listed(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        async def run() -> AsyncGenerator[Any, None]:
            async for item in listing(*args, **kwargs):
                yield item
            act()

        return run()

    return listed


async def test_listings_skip_a_linked_directory(file_kit: StoreKit, outside: pathlib.Path) -> None:
    kit = file_kit
    chain = await kit.chain(3)
    linked = (await kit.chain(2))[1]
    kit.link_out(linked, outside)
    before = snapshot(outside)
    report = await verify_store(kit.backend, VerifyOptions(processes=1))
    assert (report.objects, report.bad) == (3 + 1, [])
    out = io.StringIO()
    await inspect_store(kit.backend, InspectOptions(True, OutputFormat.JSON), out)
    assert linked not in out.getvalue() and chain[0] in out.getvalue()
    assert snapshot(outside) == before


async def test_compact_never_deletes_through_a_link_planted_after_its_scan(
    file_kit: StoreKit, outside: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kit = file_kit
    chain = await kit.chain(3)
    victims: list[pathlib.Path] = []
    backend = kit.backend
    plant = lambda: victims.append(kit.link_out(chain[-1], outside))  # noqa: E731
    monkeypatch.setattr(backend, "scan", _then(backend.scan, plant))
    report = await compact_store(backend, CompactOptions(max_bytes=1))  # evict every page
    assert victims and victims[0].exists()
    assert chain[-1] not in [r.key for r in report.removed]
    assert sorted(r.key for r in report.removed) == sorted(chain[:2])


async def test_verify_never_deletes_through_a_link_planted_after_its_read(
    file_kit: StoreKit, outside: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recheck before deletion reads the object again: through the link it would find the
    victim (not a page, so still bad) and delete it."""
    kit = file_kit
    chain = await kit.chain(3)
    await kit.flip_bit(chain[2], HEADER_SIZE + 1)
    victims: list[pathlib.Path] = []
    backend = kit.backend
    assert isinstance(backend, FileBackend)
    plant = lambda: victims.append(kit.link_out(chain[2], outside))  # noqa: E731
    monkeypatch.setattr(backend, "read_all", _then(backend.read_all, plant))
    report = await verify_store(backend, VerifyOptions(delete_bad=True, processes=1))
    assert [b.key for b in report.bad] == [chain[2]]
    assert victims and victims[0].exists()
    assert report.deleted == []


async def test_a_scan_listing_keys_behind_a_link_reads_nothing_there(
    file_kit: StoreKit, outside: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """inspect reads headers (peek) of what scan listed; a key whose directory became a link
    since reads as vanished, not as the outside file."""
    kit = file_kit
    chain = await kit.chain(3)
    backend = kit.backend
    plant = lambda: kit.link_out(chain[1], outside)  # noqa: E731
    monkeypatch.setattr(backend, "scan", _then(backend.scan, plant))
    out = io.StringIO()
    summary = await inspect_store(backend, InspectOptions(True, OutputFormat.JSON), out)
    assert chain[1] not in out.getvalue() and summary.vanished == 1
