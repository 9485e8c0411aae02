"""The ``disk`` backend: the conformance suite, its formats and its faults."""

from __future__ import annotations

import pathlib

import pytest

from hicache.backends.disk import DiskBackend, DiskConfig
from hicache.backends.disk.reads import PARALLEL_BYTES
from hicache.backends.testing import BackendConformanceTests, random_bytes
from hicache.errors import ConfigError


class TestDiskConformance(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> DiskBackend:
        return await DiskBackend.open(DiskConfig(root=str(location), segment_bytes=4 << 20))


class TestDiskDirectConformance(BackendConformanceTests):
    """``direct=true``: the same contract through O_DIRECT and aligned staging."""

    async def open_backend(self, location: pathlib.Path) -> DiskBackend:
        config = DiskConfig(root=str(location), segment_bytes=4 << 20, direct=True)
        return await DiskBackend.open(config)


@pytest.mark.asyncio
async def test_direct_io_goes_around_the_page_cache_through_staging(
    tmp_path: pathlib.Path,
) -> None:
    """direct=true writes and reads through aligned staging (counted); a buffered reader of
    the same store sees the same bytes, records that end mid-block included."""
    direct = await DiskBackend.open(DiskConfig(root=str(tmp_path), direct=True))
    values = {f"k{i}": random_bytes(1000 + 777 * i, seed=i) for i in range(12)}
    for key, value in values.items():  # one record a put: each ends mid-block
        assert await direct.put([key], [value]) == [True]
    got = await direct.get(list(values))
    stats = await direct.stats()
    if stats["direct_fallbacks"]:
        await direct.close()
        pytest.skip("this filesystem has no O_DIRECT")
    assert got == list(values.values())
    assert stats["bytes_staged"] >= 2 * sum(map(len, values.values()))
    buffered = await DiskBackend.open(DiskConfig(root=str(tmp_path), read_only=True))
    assert await buffered.get(list(values)) == list(values.values())
    assert (await buffered.stats())["bytes_staged"] == 0
    await buffered.close()
    await direct.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("threads", [1, 3])
async def test_large_batches_are_shared_by_threads_byte_exact(
    tmp_path: pathlib.Path, threads: int
) -> None:
    """A batch past PARALLEL_BYTES is read in stretches by several threads and written by two
    lanes (read and written by one with io_threads=1): every object lands whole, at its place,
    across a segment boundary."""
    config = DiskConfig(root=str(tmp_path), segment_bytes=12 << 20, io_threads=threads)
    store = await DiskBackend.open(config)
    values = [random_bytes((1 << 20) + 13 * i, seed=i) for i in range(20)]
    keys = [f"big-{i}" for i in range(20)]
    assert sum(map(len, values)) >= 2 * PARALLEL_BYTES
    assert await store.put(keys, values) == [True] * 20
    assert await store.get(keys, size_hint=2 << 20) == values
    await store.close()
    reopened = await DiskBackend.open(DiskConfig(root=str(tmp_path), io_threads=threads))
    assert await reopened.get(keys, size_hint=2 << 20) == values
    assert (await reopened.stats())["segments"] >= 2
    await reopened.close()


async def test_io_threads_default_to_the_machine_and_a_given_count_is_kept(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``io_threads``: one thread per CPU the process may use (at most 8), not a fixed 4."""
    from hicache.backends.disk import config as config_mod

    for cpus, want in ((1, 1), (2, 2), (3, 3), (64, 8)):
        monkeypatch.setattr(config_mod, "machine_threads", lambda n=cpus: n)
        assert DiskConfig(root=str(tmp_path)).threads == want
    monkeypatch.setattr(config_mod, "machine_threads", lambda: 2)
    assert DiskConfig(root=str(tmp_path), io_threads=5).threads == 5
    store = await DiskBackend.open(DiskConfig(root=str(tmp_path)))
    assert store._io is not None and store._io.threads == 2
    await store.close()
    single = await DiskBackend.open(DiskConfig(root=str(tmp_path), io_threads=1))
    assert single._io is None  # one thread: no fan-out at all
    await single.close()
    with pytest.raises(ConfigError, match="io_threads"):
        DiskConfig(root=str(tmp_path), io_threads=0)
