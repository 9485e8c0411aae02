"""Wrapper backends: transparency (the conformance suite), fault injection, latency, threads."""

from __future__ import annotations

import asyncio
import math
import pathlib
import threading
import time
from dataclasses import dataclass

import pytest
from memory_kit import read_memory_raw, write_memory_raw

from hicache.backends.base import MISS, Capabilities, StorageBackend
from hicache.backends.memory import MemoryBackend, MemoryConfig
from hicache.backends.testing import BackendConformanceTests
from hicache.backends.wrappers import (
    FaultConfig,
    FaultInjectionBackend,
    FaultMode,
    LatencyBackend,
    LatencyConfig,
    Operation,
    ThreadedBackend,
    WrapperBackend,
)
from hicache.errors import BackendUnavailableError, ConfigError, InvalidArgumentError

MB = 1 << 20


class FakeTime:
    """Virtual time: ``sleep(d)`` records ``d``, yields once, then moves the clock to its end.

    Calls that start together all read the same ``now`` before any of them moves it, so the
    delays they record show how they queue; sequential calls see the clock their
    predecessors advanced.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        start = self.now
        self.sleeps.append(seconds)
        await asyncio.sleep(0)
        self.now = max(self.now, start + seconds)


def memory() -> MemoryBackend:
    return MemoryBackend(MemoryConfig(capacity_bytes=256 << 20))


def keys_of(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


# ----- transparency ---------------------------------------------------------------------------
class _OverMemory(BackendConformanceTests):
    """A wrapper over a memory backend: the raw hooks reach the memory backend's dict."""

    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        return read_memory_raw(backend, key)

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        write_memory_raw(backend, key, data)


class TestLatencyWrapperConformance(_OverMemory):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return LatencyBackend(memory(), LatencyConfig())


class TestFaultWrapperConformance(_OverMemory):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return FaultInjectionBackend(memory(), FaultConfig())


class TestThreadedWrapperConformance(_OverMemory):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await ThreadedBackend.open_url("memory://?capacity_bytes=256M")


async def test_threaded_backend_runs_calls_on_its_own_thread() -> None:
    backend = await ThreadedBackend.open_url("memory://", capacity_bytes=1 << 20)
    caller = threading.get_ident()
    seen: list[int] = []
    real_put = backend.inner._put

    async def recording_put(keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        seen.append(threading.get_ident())
        return await real_put(keys, values)

    backend.inner._put = recording_put  # type: ignore[method-assign]
    try:
        assert isinstance(backend, WrapperBackend) and backend.capabilities.max_object_bytes
        assert await backend.put(["k"], [b"v"]) == [True]
        assert seen and seen[0] != caller  # the inner backend ran on the wrapper's thread
        stats = await backend.stats()
        assert stats["objects"] == 1 and "inner.objects" not in stats  # flat, as unwrapped
    finally:
        await backend.close()
    assert backend.inner.closed and not backend._thread._thread.is_alive()


async def test_threaded_backend_that_fails_to_open_stops_its_thread() -> None:
    before = threading.active_count()
    with pytest.raises(ConfigError):
        await ThreadedBackend.open_url("memory://?capacity_bytes=0")
    assert threading.active_count() == before


async def test_stats_are_prefixed_and_close_reaches_inner() -> None:
    inner = memory()
    inner.capabilities = Capabilities(persistent=True)
    outer = LatencyBackend(FaultInjectionBackend(inner), LatencyConfig())
    assert outer.capabilities == Capabilities(persistent=True)
    assert await outer.put(["a"], [b"xyz"]) == [True]
    stats = await outer.stats()
    assert stats["puts"] == 1 and stats["bytes_written"] == 3
    assert stats["inner.puts"] == 1 and stats["inner.injected_failures"] == 0
    assert stats["inner.inner.objects"] == 1 and stats["delayed_seconds"] == 0.0
    await outer.close()
    assert inner.closed


async def test_wrappers_are_built_in_code_not_opened() -> None:
    with pytest.raises(InvalidArgumentError, match="build it in code"):
        await FaultInjectionBackend.open(FaultConfig())
    with pytest.raises(InvalidArgumentError):
        WrapperBackend(object())  # type: ignore[arg-type]


# ----- fault injection --------------------------------------------------------------------------
@dataclass(frozen=True)
class ScriptRun:
    """Everything a fault could change in :func:`fault_script`."""

    stored: list[bool]
    found: list[bool]
    sizes: list[int]
    data: list[bytes]
    stalls: int
    stats: dict[str, int | float]


async def fault_script(config: FaultConfig) -> ScriptRun:
    """A fixed sequence of calls against a fresh memory backend."""
    fake = FakeTime()
    backend = FaultInjectionBackend(memory(), config, sleep=fake.sleep)
    keys = keys_of(200)
    stored = await backend.put(keys, [bytes([i % 251]) * 64 for i in range(200)])
    found = await backend.exists(keys)
    sizes: list[int] = []
    data: list[bytes] = []
    for start in range(0, 200, 20):  # ten calls, so stalls (per call) have room to vary
        bufs = [bytearray(64) for _ in range(20)]
        sizes += await backend.get_into(keys[start : start + 20], bufs)
        data += [bytes(b) for b in bufs]
    return ScriptRun(stored, found, sizes, data, len(fake.sleeps), await backend.stats())


async def test_same_seed_same_faults_and_different_seed_different_faults() -> None:
    config = FaultConfig(fail_rate=0.2, stall_rate=0.3, corrupt_rate=0.2, seed=7)
    first = await fault_script(config)
    assert first == await fault_script(config)
    # Faults really happened, of every kind.
    assert 0 < sum(first.stored) < 200 and MISS in first.sizes and first.stalls > 0
    assert first.stats["injected_corruptions"] > 0
    other = await fault_script(FaultConfig(fail_rate=0.2, stall_rate=0.3, corrupt_rate=0.2, seed=8))
    assert other.stored != first.stored and other.data != first.data


async def test_fault_kinds_draw_independently() -> None:
    plain = await fault_script(FaultConfig(fail_rate=0.3, seed=3))
    with_corruption = await fault_script(FaultConfig(fail_rate=0.3, corrupt_rate=0.5, seed=3))
    # Corruption draws in earlier calls do not shift the failures of later ones.
    assert plain.stored == with_corruption.stored and plain.found == with_corruption.found
    assert plain.sizes == with_corruption.sizes and plain.data != with_corruption.data


async def test_rates_are_roughly_honoured_over_2000_keys() -> None:
    fake = FakeTime()
    backend = FaultInjectionBackend(memory(), FaultConfig(), sleep=fake.sleep)
    keys, value = keys_of(2000), b"v" * 16
    backend.set_faults(FaultConfig(fail_rate=0.3, seed=1, operations=frozenset({Operation.PUT})))
    stored = await backend.put(keys, [value] * 2000)
    assert 0.25 <= stored.count(False) / 2000 <= 0.35
    assert sum(await backend.exists(keys)) == sum(stored)  # failed puts stored nothing

    backend.set_faults(FaultConfig())
    await backend.put(keys, [value] * 2000)
    backend.set_faults(FaultConfig(fail_rate=0.3, corrupt_rate=0.3, seed=2))
    bufs = [bytearray(16) for _ in keys]
    sizes = await backend.get_into(keys, bufs)
    assert 0.25 <= sizes.count(MISS) / 2000 <= 0.35
    corrupted = sum(1 for n, b in zip(sizes, bufs, strict=True) if n == 16 and bytes(b) != value)
    assert 0.25 <= corrupted / sizes.count(16) <= 0.35
    stats = await backend.stats()
    assert stats["injected_corruptions"] == corrupted

    backend.set_faults(FaultConfig(stall_rate=0.3, stall_seconds=5.0, seed=3))
    for key in keys:
        await backend.exists([key])
    assert 0.25 <= len(fake.sleeps) / 2000 <= 0.35 and set(fake.sleeps) == {5.0}


def differing_bytes(a: bytes, b: bytes) -> int:
    assert len(a) == len(b)
    return sum(x != y for x, y in zip(a, b, strict=True))


async def test_corrupt_reads_differ_in_exactly_one_byte() -> None:
    payloads = [bytes(range(256)) * 4, b"\x00" * 1000, b"z"]
    backend = FaultInjectionBackend(memory())
    await backend.put(["a", "b", "c"], payloads)
    backend.set_faults(FaultConfig(corrupt_rate=1.0, seed=5))
    for _ in range(5):
        # Scatter-gather buffers: the flipped byte may land in either segment.
        bufs = [[bytearray(600), bytearray(len(p) - 600)] for p in payloads[:2]]
        assert await backend.get_into(["a", "b"], bufs) == [1024, 1000]
        for p, (head, tail) in zip(payloads[:2], bufs, strict=True):
            assert differing_bytes(bytes(head + tail), p) == 1
    assert (await backend.get(["c"]))[0] != b"z"
    assert await backend.get_into(["a"], [bytearray(8)]) == [1024]  # too small: nothing read
    assert (await backend.stats())["injected_corruptions"] == 11
    assert await backend.inner.get(["a", "b", "c"]) == payloads  # the stored data is intact


async def test_corrupt_puts_store_one_flipped_byte_and_leave_caller_data_alone() -> None:
    backend = FaultInjectionBackend(memory(), FaultConfig(corrupt_rate=1.0, seed=9))
    value = bytearray(b"abcdefgh" * 100)
    assert await backend.put(["a"], [[value[:300], value[300:]]]) == [True]
    assert value == b"abcdefgh" * 100
    (stored,) = await backend.inner.get(["a"])
    assert stored is not None and differing_bytes(stored, bytes(value)) == 1
    assert (await backend.stats())["injected_corruptions"] == 1


async def test_raise_mode_raises_the_typed_error_and_skips_the_call() -> None:
    backend = FaultInjectionBackend(memory(), FaultConfig(fail_rate=1.0, fail_mode=FaultMode.RAISE))
    with pytest.raises(BackendUnavailableError, match="put"):
        await backend.put(["a"], [b"x"])
    with pytest.raises(BackendUnavailableError, match="get"):
        await backend.get_into(["a"], [bytearray(1)])
    with pytest.raises(BackendUnavailableError):
        await backend.exists(["a"])
    with pytest.raises(BackendUnavailableError):
        await backend.delete(["a"])
    assert await backend.inner.exists(["a"]) == [False]
    assert (await backend.stats())["injected_failures"] == 4


async def test_stall_is_cancelled_cleanly_by_a_timeout() -> None:
    backend = FaultInjectionBackend(memory(), FaultConfig(stall_rate=1.0, stall_seconds=30.0))
    started = time.perf_counter()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(backend.put(["a"], [b"x"]), timeout=0.02)
    assert time.perf_counter() - started < 5.0
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert await backend.inner.exists(["a"]) == [False]  # the stalled put never reached storage
    backend.set_faults(FaultConfig())
    assert await backend.put(["a"], [b"x"]) == [True]
    assert (await backend.stats())["injected_stalls"] == 1


async def test_operations_filter_limits_which_calls_fail() -> None:
    backend = FaultInjectionBackend(memory())
    await backend.put(["a", "b"], [b"1", b"2"])
    backend.set_faults(FaultConfig(fail_rate=1.0, operations=frozenset({Operation.PUT})))
    assert await backend.put(["c"], [b"3"]) == [False]
    assert await backend.exists(["a", "b", "c"]) == [True, True, False]
    assert await backend.get(["a"]) == [b"1"]
    backend.set_faults(FaultConfig(fail_rate=1.0, operations=frozenset({Operation.DELETE})))
    assert await backend.delete(["a"]) == [False]
    assert await backend.exists(["a"]) == [True]
    backend.set_faults(FaultConfig(fail_rate=1.0, operations=frozenset({Operation.EXISTS})))
    assert await backend.exists(["a", "b"]) == [False, False]
    assert await backend.get(["b"]) == [b"2"]


async def test_set_faults_switches_healthy_failing_healthy() -> None:
    backend = FaultInjectionBackend(memory())
    assert await backend.put(["a"], [b"1"]) == [True]
    backend.set_faults(FaultConfig(fail_rate=1.0))
    assert await backend.put(["b"], [b"2"]) == [False]
    assert await backend.get_into(["a"], [bytearray(1)]) == [MISS]
    backend.set_faults(FaultConfig())
    assert await backend.put(["b"], [b"2"]) == [True]
    assert await backend.get(["a", "b"]) == [b"1", b"2"]
    stats = await backend.stats()
    assert stats["injected_failures"] == 2 and stats["put_failures"] == 1


async def test_set_faults_restarts_the_seeded_pattern() -> None:
    config = FaultConfig(fail_rate=0.5, seed=11)
    backend = FaultInjectionBackend(memory(), config)
    first = await backend.put(keys_of(100), [b"x"] * 100)
    backend.set_faults(config)
    again = await backend.put([f"other{i}" for i in range(100)], [b"x"] * 100)
    assert first == again and 20 < sum(first) < 80


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fail_rate": -0.1},
        {"stall_rate": 1.5},
        {"corrupt_rate": math.nan},
        {"stall_seconds": -1.0},
        {"fail_mode": "raise"},
        {"operations": frozenset({"put"})},
    ],
)
def test_fault_config_is_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        FaultConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"latency_s": -1.0}, {"latency_s": math.inf}, {"read_bandwidth_bps": 0}],
)
def test_latency_config_is_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LatencyConfig(**kwargs)  # type: ignore[arg-type]


# ----- latency and bandwidth --------------------------------------------------------------------
def slow_link(fake: FakeTime, latency_s: float = 0.0) -> LatencyBackend:
    config = LatencyConfig(latency_s=latency_s, read_bandwidth_bps=MB, write_bandwidth_bps=MB)
    return LatencyBackend(memory(), config, sleep=fake.sleep, clock=fake.clock)


async def test_latency_plus_bytes_over_bandwidth() -> None:
    fake = FakeTime()
    backend = slow_link(fake, latency_s=0.01)
    await backend.put(["a"], [b"x" * (MB // 2)])
    assert await backend.exists(["a", "b"]) == [True, False]
    assert await backend.get_into(["a"], [bytearray(MB)]) == [MB // 2]
    assert await backend.get_into(["b"], [bytearray(8)]) == [MISS]  # a miss moves no bytes
    assert await backend.get_into(["a"], [bytearray(8)]) == [MB // 2]  # too small: no bytes
    await backend.delete(["a"])
    assert fake.sleeps == pytest.approx([0.51, 0.01, 0.51, 0.01, 0.01, 0.01])
    assert fake.now == pytest.approx(1.06)
    assert (await backend.stats())["delayed_seconds"] == pytest.approx(1.06)


async def test_concurrent_transfers_share_the_link() -> None:
    fake = FakeTime()
    backend = slow_link(fake)
    keys = keys_of(4)
    await backend.put(keys, [b"x" * MB] * 4)  # one call of 4 MB: 4 s
    assert fake.sleeps == pytest.approx([4.0]) and fake.now == pytest.approx(4.0)
    fake.sleeps.clear()

    reads = [backend.get_into([k], [bytearray(MB)]) for k in keys]
    assert await asyncio.gather(*reads) == [[MB]] * 4
    assert fake.sleeps == pytest.approx([1.0, 2.0, 3.0, 4.0])  # queued, not parallel
    assert fake.now == pytest.approx(8.0)

    # A read that arrives while the link is still busy waits for the rest of that transfer.
    fake.sleeps.clear()
    first = asyncio.ensure_future(backend.get_into(["k0"], [bytearray(MB)]))
    await asyncio.sleep(0)  # it has booked 8..9 on the link
    fake.now += 0.5
    await backend.get_into(["k1"], [bytearray(MB)])
    await first
    assert fake.sleeps == pytest.approx([1.0, 1.5])


async def test_reads_and_writes_use_separate_links() -> None:
    fake = FakeTime()
    backend = slow_link(fake)
    await backend.put(["a"], [b"x" * MB])
    fake.sleeps.clear()
    await asyncio.gather(backend.get_into(["a"], [bytearray(MB)]), backend.put(["b"], [b"y" * MB]))
    assert fake.sleeps == pytest.approx([1.0, 1.0])


async def test_real_latency_overlaps_across_concurrent_calls() -> None:
    backend = LatencyBackend(memory(), LatencyConfig(latency_s=0.025))
    started = time.perf_counter()
    assert await backend.exists(["a"]) == [False]
    assert time.perf_counter() - started >= 0.024
    started = time.perf_counter()
    await asyncio.gather(*(backend.exists([f"k{i}"]) for i in range(8)))
    elapsed = time.perf_counter() - started
    assert 0.024 <= elapsed < 0.15  # one after another would take 0.2 s
