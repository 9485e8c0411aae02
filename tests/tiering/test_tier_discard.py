"""A cache whose namespaces are scratch (``storage.discard_on_close``) deletes its L3 pages when
it closes, and nothing else: not another model's, not its own when the flag is off."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import pytest
from gated_kit import quiesce, tokens
from tier_kit import Harness

from hicache.backends.base import StorageBackend
from hicache.backends.memory import MemoryBackend, MemoryConfig
from hicache.backends.registry import open_backend
from hicache.backends.wrappers import FaultConfig, FaultInjectionBackend, FaultMode, Operation
from hicache.keys import namespace_digest, namespace_tag
from hicache.tiering.common.config import StorageConfig
from hicache.tiering.controller import discard_namespaces

SEQ = tokens(1, 8)
OTHER = tokens(5000, 6)


async def stored_keys(url: str) -> list[str]:
    async with await open_backend(url) as backend:
        return sorted([info.key async for info in backend.scan()])


async def write(h: Harness, *requests: tuple[list[int], str | None]) -> None:
    for i, (seq, extra_key) in enumerate(requests):
        h.run_request(f"r{i}", seq, extra_key)
    await quiesce(h)


def scratch(model_id: str, discard: bool = True) -> dict[str, object]:
    return {"storage": StorageConfig(model_id=model_id, discard_on_close=discard)}


@pytest.mark.parametrize("discard", [True, False], ids=["scratch", "kept"])
async def test_closing_deletes_every_namespace_it_wrote_and_nothing_else(
    tmp_path: pathlib.Path, discard: bool
) -> None:
    url = f"file://{tmp_path}/l3"
    keeper = await Harness.build(url=url, **scratch("shared-model", discard=False))
    await write(keeper, (SEQ, None))
    await keeper.tree.close()
    kept = await stored_keys(url)
    assert len(kept) == 8
    run = await Harness.build(url=url, **scratch("run-model", discard))
    await write(run, (SEQ, None), (OTHER, "tenant-a"), (OTHER, "tenant-b"))
    written = run.controller.metrics.counts["pages_written_l3"]
    assert written == 8 + 6 + 6  # the same tokens in three namespaces: three sets of pages
    await run.tree.close()
    left = await stored_keys(url)
    if discard:
        assert left == kept  # the other model's pages are untouched
        assert run.controller.metrics.counts["l3_discarded_objects"] == written
    else:
        assert len(left) == len(kept) + written
        assert run.controller.metrics.counts["l3_discarded_objects"] == 0
    tags = {namespace_tag(namespace_digest("run-model", e)) for e in (None, "tenant-a", "tenant-b")}
    assert run.tree.writer.hasher.namespace_tags() == tags
    assert {key.split("-")[0] for key in kept} == {namespace_tag(namespace_digest("shared-model"))}


async def test_writes_still_queued_are_dropped_not_left_behind(tmp_path: pathlib.Path) -> None:
    """Close right after the writes are queued, with a drain time: none of them lands after the
    scratch cache's pages were deleted."""
    url = f"file://{tmp_path}/l3"
    run = await Harness.build(url=url, **scratch("run-model"))
    for i in range(6):
        run.run_request(f"r{i}", tokens(100 * (i + 1), 8))
    assert run.controller.metrics.counts["pages_submitted_l3"] == 48
    await run.tree.close(drain_s=30.0)
    assert await stored_keys(url) == []


class _Unlistable(MemoryBackend):
    """A memory store that says it cannot list (as Mooncake's does)."""

    def __init__(self, config: MemoryConfig) -> None:
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, listable=False)


async def test_a_backend_that_cannot_list_keeps_the_pages_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = _Unlistable(MemoryConfig())
    run = await Harness.build(backend=backend, **scratch("run-model"))
    await write(run, (SEQ, None))
    assert len(backend._objects) == 8
    with caplog.at_level(logging.WARNING, logger="hicache.tiering.controller"):
        await run.tree.close()
    assert "cannot list its keys" in caplog.text
    assert run.controller.metrics.counts["l3_discarded_objects"] == 0
    assert backend._counters["deletes"] == 0


async def test_a_failing_delete_is_logged_and_close_still_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = MemoryBackend(MemoryConfig())
    faults = FaultConfig(1.0, FaultMode.RAISE, operations=frozenset({Operation.DELETE}))
    backend: StorageBackend = FaultInjectionBackend(inner, faults)
    run = await Harness.build(backend=backend, **scratch("run-model"))
    await write(run, (SEQ, None))
    with caplog.at_level(logging.WARNING, logger="hicache.tiering.controller"):
        await run.tree.close()
    assert "discarding L3 pages failed after 0 objects" in caplog.text
    assert backend.closed and inner.closed


async def test_discarding_no_namespace_or_another_one_deletes_nothing(
    tmp_path: pathlib.Path,
) -> None:
    async with await open_backend(f"file://{tmp_path}/l3") as backend:
        key = f"{namespace_tag(namespace_digest('kept-model'))}-0000000000000000-00"
        assert await backend.put([key], [b"page"]) == [True]
        assert await discard_namespaces(backend, ()) == 0
        assert await discard_namespaces(backend, {"0123456789abcdef"}) == 0
        assert await backend.exists([key]) == [True]
