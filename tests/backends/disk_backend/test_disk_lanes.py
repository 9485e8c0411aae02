"""The ``disk`` backend's two write lanes: a large batch cut in two, each half into a segment
of its own, written at once; one log frame names the records only once both are written."""

from __future__ import annotations

import pathlib

import pytest

from hicache.backends.disk import DiskBackend, DiskConfig
from hicache.backends.disk.lanes import SegmentLane
from hicache.backends.disk.writer import LANE_BYTES
from hicache.backends.testing import random_bytes

pytestmark = pytest.mark.asyncio

_PAGE = 3 << 20  # 8 pages: 24 MiB, past LANE_BYTES


def _pages(prefix: str, count: int = 8) -> tuple[list[str], list[bytes]]:
    keys = [f"{prefix}-{i}" for i in range(count)]
    return keys, [
        random_bytes(_PAGE + 64 * i, seed=sum(key.encode()) + i) for i, key in enumerate(keys)
    ]


async def _open(root: pathlib.Path, **options: object) -> DiskBackend:
    return await DiskBackend.open(DiskConfig(root=str(root), segment_bytes=64 << 20, **options))


async def test_a_large_batch_is_written_by_two_lanes_into_two_segments(
    tmp_path: pathlib.Path,
) -> None:
    store = await _open(tmp_path, io_threads=2)
    keys, values = _pages("big")
    assert sum(map(len, values)) >= LANE_BYTES
    assert await store.put(keys, values) == [True] * len(keys)
    appender = store._appender
    assert appender is not None and len(appender.open_segments) == 2
    assert await store.get(keys, size_hint=_PAGE + 1024) == values
    small_keys, small = ["small-0", "small-1"], [b"a" * 100, b"b" * 200]
    assert await store.put(small_keys, small) == [True, True]  # under LANE_BYTES: one lane
    await store.close()
    reopened = await _open(tmp_path, read_only=True)
    assert await reopened.get(keys + small_keys, size_hint=_PAGE + 1024) == values + small
    assert (await reopened.stats())["segments"] == 2
    await reopened.close()


@pytest.mark.parametrize("options", [{"io_threads": 1}, {"io_threads": 2, "capacity": 256 << 20}])
async def test_one_lane_with_one_thread_or_little_room(
    tmp_path: pathlib.Path, options: dict[str, int]
) -> None:
    """One thread: nothing to write the second half; a capacity of under 8 segments: a second
    open segment, which no reclaim may take, would pin too much of it."""
    store = await _open(tmp_path, **options)
    keys, values = _pages("big")
    assert await store.put(keys, values) == [True] * len(keys)
    appender = store._appender
    assert appender is not None and len(appender.lanes) == 1
    assert await store.get(keys, size_hint=_PAGE + 1024) == values
    await store.close()


async def test_a_failed_lane_fails_only_its_half_and_names_none_of_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second lane's write fails: its half is not stored (False, counted, never indexed,
    not even after a reopen replays the log), the first half is, and the next put works."""
    store = await _open(tmp_path, io_threads=2)
    appender = store._appender
    assert appender is not None
    second = appender.lanes[1]
    real_write = SegmentLane.write

    def failing(self: SegmentLane, iov: list, offset: int, nbytes: int) -> bool:
        if self is second:
            self.shared.count_error(OSError(5, "injected"), "a write failed")
            self.seal()
            return False
        return real_write(self, iov, offset, nbytes)

    monkeypatch.setattr(SegmentLane, "write", failing)
    keys, values = _pages("half")
    stored = await store.put(keys, values)
    cut = stored.index(False)
    assert cut > 0 and stored == [True] * cut + [False] * (len(keys) - cut)
    assert (await store.stats())["put_errors"] == 1
    monkeypatch.setattr(SegmentLane, "write", real_write)
    assert await store.get(keys[:cut], size_hint=_PAGE + 1024) == values[:cut]
    assert await store.exists(keys[cut:]) == [False] * (len(keys) - cut)
    again_keys, again = _pages("again")
    assert await store.put(again_keys, again) == [True] * len(again_keys)
    await store.close()
    reopened = await _open(tmp_path, read_only=True)
    assert await reopened.exists(keys) == stored
    assert await reopened.get(again_keys, size_hint=_PAGE + 1024) == again
    await reopened.close()
