"""The mooncake backend against a real ``mooncake_master`` on 127.0.0.1.

The conformance suite shares one master (short lease); each test's store is a fresh client
whose keys live under a prefix derived from its location. Tests that fill the store or crash
the master get a master of their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import pathlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.mooncake import MooncakeBackend, MooncakeConfig
from hicache.backends.mooncake import connection as mooncake_connection
from hicache.backends.mooncake.client import load_store_class
from hicache.backends.mooncake.gate import Gate
from hicache.backends.mooncake.plan import RegisteredRanges
from hicache.backends.registry import default_registry
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import BackendLoadError, BackendUnavailableError, ConfigError
from hicache.tools.services.mooncake import MooncakeMaster
from hicache.tools.services.process import free_port


def _mooncake_missing() -> str | None:
    try:
        load_store_class()
        from hicache.tools.services.mooncake import mooncake_master_path

        mooncake_master_path()
    except (BackendLoadError, BackendUnavailableError, OSError) as exc:
        return str(exc)
    return None


_MISSING = _mooncake_missing()
needs_mooncake = pytest.mark.skipif(_MISSING is not None, reason=f"Mooncake: {_MISSING}")


def _start_master(directory: pathlib.Path, lease_ttl_ms: int = 500) -> MooncakeMaster:
    master = MooncakeMaster(lease_ttl_ms, str(directory / "master.log"))
    master.start()
    return master


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master for the module, and one backend held open on it all along.

    Backends opened with the same settings share one Mooncake client, so the held one keeps
    it alive between tests: each test's open and close then cost milliseconds, not the 1.5-3 s
    of a client's setup and teardown.
    """
    if _MISSING is not None:
        pytest.skip(f"Mooncake: {_MISSING}")
    started = _start_master(tmp_path_factory.mktemp("mooncake"))
    try:
        anchor = asyncio.run(_open(started, key_prefix="anchor/"))
        try:
            yield started
        finally:
            asyncio.run(anchor.close())  # before the master stops: a teardown needs it
    finally:
        started.stop()


@pytest.fixture
def own_master(tmp_path: pathlib.Path) -> Iterator[MooncakeMaster]:
    """A master for one test: full-store and crash tests must not disturb the others."""
    if _MISSING is not None:
        pytest.skip(f"Mooncake: {_MISSING}")
    started = _start_master(tmp_path)
    yield started
    started.stop()


async def _open(master: MooncakeMaster, **options: object) -> MooncakeBackend:
    values = {"global_segment_bytes": "256M", "staging_bytes": "16M", **options}
    cls, url = default_registry.resolve_url(master.url(**values))
    backend = await cls.open(cls.config_from_url(url, {}))
    assert isinstance(backend, MooncakeBackend)
    return backend


@needs_mooncake
class TestMooncakeConformance(BackendConformanceTests):
    # The suite's 64 MiB object fits: _open's 256 MiB segment holds twice that and more.
    @pytest.fixture(autouse=True)
    def _use_master(self, master: MooncakeMaster) -> None:
        self.master = master

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        # The same location gives the same key namespace, a new one gives an empty store.
        prefix = hashlib.sha1(str(location).encode()).hexdigest()[:16] + "/"
        return await _open(self.master, key_prefix=prefix)

    @pytest.mark.slow  # every step is a round trip to the master and its segment
    def test_matches_reference_model(self, tmp_path: pathlib.Path) -> None:
        super().test_matches_reference_model(tmp_path)


# ----- memory paths -----------------------------------------------------------------------------
@needs_mooncake
@pytest.mark.asyncio
async def test_registered_memory_moves_zero_copy(master: MooncakeMaster) -> None:
    backend = await _open(master, key_prefix="zc/")
    try:
        pool = np.zeros(8 << 20, dtype=np.uint8)
        assert backend.register_memory(pool) is True
        assert backend.register_memory(pool[1024:2048]) is False  # already inside
        rng = np.random.default_rng(1)
        pool[: 4 << 20] = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
        pages = [pool[i << 20 : (i + 1) << 20] for i in range(4)]
        before = await backend.stats()
        assert await backend.put([f"p{i}" for i in range(4)], pages) == [True] * 4
        dest = [pool[(4 + i) << 20 : (5 + i) << 20] for i in range(4)]
        assert await backend.get_into([f"p{i}" for i in range(4)], dest) == [1 << 20] * 4
        after = await backend.stats()
        assert np.array_equal(pool[4 << 20 :], pool[: 4 << 20])
        assert after["zero_copy_bytes"] - before["zero_copy_bytes"] == 8 << 20
        assert after["bytes_staged"] == before["bytes_staged"]
        # Unregistered memory takes the staging path, with the same result.
        plain = bytearray(1 << 20)
        assert await backend.get_into(["p1"], [plain]) == [1 << 20]
        assert bytes(plain) == pages[1].tobytes()
        assert (await backend.stats())["bytes_staged"] - after["bytes_staged"] == 1 << 20
        assert backend.unregister_memory(pool) is True
    finally:
        await backend.close()


def _host_memory(pages: int, page_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A host pool of random pages and a header arena of 160-byte slots, as the tier has."""
    rng = np.random.default_rng(pages)
    pool = rng.integers(0, 256, pages * page_bytes, dtype=np.uint8)
    return pool, rng.integers(0, 256, pages * 160, dtype=np.uint8)


def _page(pool: np.ndarray, arena: np.ndarray, i: int, page_bytes: int) -> list[np.ndarray]:
    return [arena[i * 160 : (i + 1) * 160], pool[i * page_bytes : (i + 1) * page_bytes]]


@needs_mooncake
@pytest.mark.asyncio
async def test_header_and_page_in_registered_memory_move_zero_copy(
    master: MooncakeMaster,
) -> None:
    backend = await _open(master, key_prefix="sg/")
    try:
        size = 256 << 10
        pool, arena = _host_memory(8, size)  # pages 0-3 are written, 4-7 read into
        assert backend.register_memory(pool) and backend.register_memory(arena)
        keys = [f"page-{i}" for i in range(4)]
        before = await backend.stats()
        assert (
            await backend.put(keys, [_page(pool, arena, i, size) for i in range(4)]) == [True] * 4
        )
        dest = [_page(pool, arena, 4 + i, size) for i in range(4)]
        assert await backend.get_into(keys, dest) == [160 + size] * 4
        assert np.array_equal(pool[4 * size :], pool[: 4 * size])
        assert np.array_equal(arena[640:], arena[:640])
        after = await backend.stats()
        assert after["bytes_staged"] == before["bytes_staged"]  # the client's: deltas only
        assert after["zero_copy_bytes"] - before["zero_copy_bytes"] == 8 * (160 + size)
        # Unregistered segments go through staging, counted; so does an overwrite, even from
        # registered memory (a multi-buffer put leaves an existing object as it was).
        plain = [bytes(range(160)), bytes(1000)]
        newer = _page(pool, arena, 1, size)
        assert await backend.put(["plain", keys[0]], [plain, newer]) == [True] * 2
        got = await backend.get(["plain", keys[0]])
        assert got == [b"".join(plain), b"".join(x.tobytes() for x in newer)]
        staged = (await backend.stats())["bytes_staged"] - after["bytes_staged"]
        assert staged == 2 * (1160 + 160 + size)  # each put, then each read (into bytes)
        assert backend.unregister_memory(pool) and backend.unregister_memory(arena)
    finally:
        await backend.close()


@needs_mooncake
@pytest.mark.asyncio
async def test_put_missing_from_registered_memory_is_one_native_put(
    master: MooncakeMaster,
) -> None:
    """Pages in registered memory go through Mooncake's multi-buffer put alone, which keeps
    an object already stored (no existence check, no staging)."""
    backend = await _open(master, key_prefix="pm/")
    try:
        size = 64 << 10
        pool, arena = _host_memory(4, size)
        assert backend.register_memory(pool) and backend.register_memory(arena)
        assert await backend.put(["kept"], [_page(pool, arena, 0, size)]) == [True]
        original = (await backend.get(["kept"]))[0]
        pool[: 4 * size] ^= 0xFF  # every page changes: "kept" must not
        before = await backend.stats()
        pages = [_page(pool, arena, i, size) for i in range(2)]
        assert await backend.put_missing(["kept", "fresh"], pages) == [True, True]
        got = await backend.get(["kept", "fresh"])
        assert got[0] == original
        assert got[1] == b"".join(x.tobytes() for x in pages[1])
        after = await backend.stats()
        assert after["bytes_staged"] - before["bytes_staged"] == 2 * (160 + size)  # the gets
        # Not wholly in registered memory: the base's check and put, staged.
        assert await backend.put_missing(["kept", "plain"], [b"x" * 10, b"y" * 10]) == [True] * 2
        assert await backend.get(["kept", "plain"]) == [original, b"y" * 10]
        assert backend.unregister_memory(pool) and backend.unregister_memory(arena)
    finally:
        await backend.close()


@needs_mooncake
@pytest.mark.asyncio
async def test_registered_scattered_reads_of_other_sizes(master: MooncakeMaster) -> None:
    backend = await _open(master, key_prefix="sz/")
    try:
        size = 4096
        pool, arena = _host_memory(7, size)
        backend.register_memory(pool)
        backend.register_memory(arena)
        value = b"H" * 160 + b"P" * 3000  # smaller than a header slot and a page
        mixed = [_page(pool, arena, 0, size), b"single", value]  # scattered, staged, staged
        assert await backend.put(["full", "single", "short"], mixed) == [True] * 3
        assert await backend.put(["empty"], [b""]) == [True]
        # Buffers larger than the object (re-read over just its bytes), one too small (its
        # size), a key twice, an empty object and a miss, all into registered pairs.
        keys = ["short", "full", "full", "single", "empty", "absent", "short"]
        dest = [_page(pool, arena, i, size) for i in range(1, 6)]
        small = [arena[6 * 160 : 6 * 160 + 16], pool[6 * size : 6 * size + 1000]]
        got = await backend.get_into(keys, [*dest, dest[4], small])
        assert got == [3160, 160 + size, 160 + size, 6, 0, MISS, 3160]
        assert bytes(arena[160:320]) + pool[size : size + 3000].tobytes() == value
        assert bytes(arena[640:646]) == b"single"
        for i in (2, 3):
            assert np.array_equal(arena[i * 160 : (i + 1) * 160], arena[:160])
            assert np.array_equal(pool[i * size : (i + 1) * size], pool[:size])
        # A scattered put over an empty object replaces it.
        assert await backend.put(["empty"], [_page(pool, arena, 0, size)]) == [True]
        assert await backend.get(["empty"], size_hint=8192) == [b"".join(mixed[0])]
    finally:
        await backend.close()


@needs_mooncake
@pytest.mark.asyncio
async def test_staging_splits_batches_and_oversize_objects(master: MooncakeMaster) -> None:
    backend = await _open(master, key_prefix="st/", staging_bytes="64K")
    try:
        values = [bytes([i]) * (30 << 10) for i in range(5)]  # 150 KiB: three staging rounds
        big = np.arange(50_000, dtype="<u4").view(np.uint8)  # 195 KiB: larger than staging
        parts = [b"head", memoryview(big), b"tail"]
        assert (
            await backend.put(["s0", "s1", "s2", "s3", "s4", "big"], [*values, parts]) == [True] * 6
        )
        expected = [*values, b"head" + big.tobytes() + b"tail"]
        buffers = [bytearray(len(v)) for v in expected]
        keys = ["s0", "s1", "s2", "s3", "s4", "big"]
        assert await backend.get_into(keys, buffers) == [len(v) for v in expected]
        assert buffers == expected
        assert (await backend.stats())["oversize_moves"] == 2  # the big put and its read
        # Buffers larger than staging: each read gets a registered buffer of its own.
        assert await backend.get(["big", "s4"], size_hint=300 << 10) == [expected[5], values[4]]
        assert (await backend.stats())["oversize_moves"] == 4
    finally:
        await backend.close()


# ----- failures -----------------------------------------------------------------------------
@needs_mooncake
@pytest.mark.asyncio
async def test_full_store_puts_false_and_counts(
    own_master: MooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await _open(own_master, global_segment_bytes="16M")
    try:
        value = np.ones(1 << 20, dtype=np.uint8)
        with caplog.at_level(logging.WARNING, logger="hicache.backends.mooncake"):
            results = []
            for batch in range(3):
                keys = [f"full-{batch}-{i}" for i in range(16)]
                results += await backend.put(keys, [value] * 16)
        refused = results.count(False)
        assert refused >= 16  # 48 MiB offered to a 16 MiB store
        stats = await backend.stats()
        assert stats["put_full"] == refused == stats["put_failures"]
        assert len([r for r in caplog.records if "full" in r.getMessage()]) == 1  # rate-limited
        assert results.count(True) >= 1
    finally:
        await backend.close()


@needs_mooncake
@pytest.mark.asyncio
@pytest.mark.parametrize("rebuild_after_s", [60.0, 0.0], ids=["library-reconnects", "rebuild"])
async def test_master_crash_degrades_then_recovers(
    own_master: MooncakeMaster, rebuild_after_s: float
) -> None:
    backend = await _open(own_master, retry_backoff_s=0.2, rebuild_after_s=rebuild_after_s)
    try:
        assert await backend.put(["before"], [b"x" * 100]) == [True]
        own_master.kill()
        started = time.monotonic()
        for _ in range(5):  # never an exception: misses and False, counted
            assert await backend.exists(["before"]) == [False]
            assert await backend.get_into(["before"], [bytearray(100)]) == [MISS]
            assert await backend.put(["during"], [b"y" * 10]) == [False]
            assert await backend.delete(["before"]) == [False]
        assert time.monotonic() - started < 15  # failing calls are turned away, not waited out
        stats = await backend.stats()
        assert stats["rpc_errors"] >= 1 and stats["unavailable"] >= 1
        own_master.restart()  # same ports; the new master is empty
        assert await _eventually_works(backend, timeout_s=30)
        assert (await backend.stats())["rebuilds"] >= (1 if rebuild_after_s == 0 else 0)
    finally:
        await backend.close()


async def _eventually_works(backend: MooncakeBackend, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await backend.put(["after"], [b"z" * 64]) == [True]:
            return await backend.get(["after"]) == [b"z" * 64]
        await asyncio.sleep(0.2)
    return False


@needs_mooncake
@pytest.mark.asyncio
async def test_close_with_a_dead_master_keeps_the_loop_running(
    own_master: MooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await _open(own_master)
    assert await backend.put(["before"], [b"x" * 100]) == [True]
    own_master.kill()
    await asyncio.sleep(1.0)  # from about here on, the client's close() took 14-19 s
    gaps: list[float] = []
    ticking = True

    async def tick() -> None:
        last = time.monotonic()
        while ticking:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hicache.backends.mooncake"):
        await backend.close()
    took = time.monotonic() - started
    await asyncio.sleep(0.05)
    ticking = False
    await ticker
    assert max(gaps) < 0.25, f"the event loop stopped for {max(gaps):.2f} s during close"
    assert took < 3.0  # the default close_timeout_s is 2 s
    assert (await backend.stats())["close_abandoned"] == 1
    assert len([r for r in caplog.records if "did not answer at close" in r.getMessage()]) == 1
    # With its master back, the abandoned client closes; otherwise Mooncake's exit handler
    # would wait out the dead master when the test process ends.
    own_master.restart()
    assert await _eventually_closes_abandoned(timeout_s=30)


async def _eventually_closes_abandoned(timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(mooncake_connection.close_abandoned) == 0:
            return True
        await asyncio.sleep(0.2)
    return False


@needs_mooncake
@pytest.mark.asyncio
async def test_unreachable_master_at_open_is_a_typed_error() -> None:
    port = free_port()
    with pytest.raises(BackendUnavailableError, match=f"127.0.0.1:{port}.*mooncake_master"):
        await MooncakeBackend.open(MooncakeConfig(master=f"127.0.0.1:{port}"))


# ----- configuration, registry, helpers (no master needed) ----------------------------------
def test_registry_resolves_mooncake_urls() -> None:
    url = (
        "mooncake://10.0.0.5:50051?metadata_server=http://10.0.0.5:8080/metadata"
        "&global_segment_bytes=4G&staging_bytes=32M&key_prefix=run1/&protocol=tcp"
    )
    cls, backend_url = default_registry.resolve_url(url)
    assert cls.__name__ == "MooncakeBackend" and cls.name == "mooncake"
    config = cls.config_from_url(backend_url, {})
    assert (config.master, config.metadata_server) == (
        "10.0.0.5:50051",
        "http://10.0.0.5:8080/metadata",
    )
    assert (config.global_segment_bytes, config.staging_bytes) == (4 << 30, 32 << 20)
    assert config.key_prefix == "run1/" and config.admin_url is None
    assert cls.config_from_url("mooncake://host", {}).master == "host:50051"
    with pytest.raises(ConfigError, match="key_prefix"):
        cls.config_from_url("mooncake://h:1?key_prefix=a%23b", {})
    with pytest.raises(ConfigError, match="close_timeout_s"):
        cls.config_from_url("mooncake://h:1?close_timeout_s=0", {})
    with pytest.raises(ConfigError, match="take no path"):
        cls.config_from_url("mooncake://h:1/some/path", {})


def test_listing_needs_the_admin_url() -> None:
    assert MooncakeBackend.capabilities.listable is False
    assert MooncakeBackend(MooncakeConfig(admin_url="http://127.0.0.1:9003")).capabilities.listable
    assert not MooncakeBackend(MooncakeConfig()).capabilities.listable


@pytest.mark.asyncio
async def test_scan_without_admin_url_raises() -> None:
    backend = MooncakeBackend(MooncakeConfig())  # never connected: scan needs no client
    with pytest.raises(ConfigError, match="admin_url"):
        _ = [info async for info in backend.scan("")]
    await backend.close()


def test_missing_library_names_the_install_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fail(name: str, *args: object) -> object:
        if name == "mooncake.store":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(BackendLoadError) as caught:
        load_store_class()
    message = str(caught.value)
    assert "pip install 'hicache[mooncake]'" in message and "apt-get install libibverbs1" in message


def test_registered_ranges_containment() -> None:
    ranges = RegisteredRanges()
    ranges.add(1000, 100)
    ranges.add(5000, 10)
    assert ranges.contains(1000, 100) and ranges.contains(1050, 50) and ranges.contains(5000, 10)
    assert not ranges.contains(999, 2) and not ranges.contains(1050, 51)
    assert not ranges.contains(2000, 1) and not ranges.contains(5005, 6)
    assert ranges.overlaps(1099, 5) and not ranges.overlaps(1100, 100)
    assert ranges.remove(1000) == 100 and ranges.remove(1000) is None
    assert ranges.nbytes == 10


def test_gate_backs_off_and_resets() -> None:
    gate = Gate(backoff_s=1.0, rebuild_after_s=5.0)
    assert gate.may_try(0.0) and not gate.down
    gate.failed(10.0)
    assert gate.down and not gate.may_try(10.5) and gate.may_try(11.0)
    gate.failed(11.0)  # second failure: waits twice as long
    assert not gate.may_try(12.5) and gate.may_try(13.0)
    assert not gate.should_rebuild(14.0) and gate.should_rebuild(15.0)
    gate.succeeded()
    assert not gate.down and gate.may_try(0.0) and not gate.should_rebuild(99.0)
