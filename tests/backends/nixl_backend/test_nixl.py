"""The nixl backend: the conformance suite in POSIX mode (real NIXL POSIX plugin on a tmp dir) and
OBJ mode (real NIXL OBJ plugin against the moto S3 server), then what only NIXL can get wrong."""

from __future__ import annotations

import asyncio
import importlib
import os
import pathlib
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.registry import default_registry, open_backend
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import BackendUnavailableError, ConfigError, InvalidArgumentError
from hicache.tools.services.moto import MotoServer


def _nixl_api() -> Any:
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("NIXL is not installed (pip install 'hicache[nixl]')", allow_module_level=True)


_API = _nixl_api()

from hicache.backends.nixl import NixlBackend, NixlConfig, NixlPlugin, PosixQueue  # noqa: E402
from hicache.backends.nixl.agent import NixlPluginError, create_plugin  # noqa: E402


def _obj_plugin_loads() -> bool:
    """Whether this NIXL build can create its OBJ plugin (the cu13 one needs libcuobjclient)."""
    agent = _API.nixl_agent(f"probe-{uuid.uuid4().hex[:8]}", _API.nixl_agent_config(backends=[]))
    params = {"bucket": "probe", "endpoint_override": "http://127.0.0.1:9", "scheme": "http"}
    try:
        create_plugin(agent, "OBJ", params)
    except NixlPluginError:
        return False
    return True


_OBJ = _obj_plugin_loads()


@pytest.fixture
def moto(moto_s3: MotoServer) -> MotoServer:
    if not _OBJ:
        pytest.skip("this NIXL build cannot load its OBJ plugin (install nixl-cu12)")
    return moto_s3


async def open_posix(root: pathlib.Path, **options: Any) -> NixlBackend:
    return await NixlBackend.open(NixlConfig(path=str(root), **options))


@pytest.fixture
async def store(tmp_path: pathlib.Path) -> AsyncIterator[NixlBackend]:
    backend = await open_posix(tmp_path / "store")
    yield backend
    await backend.close()


_SESSION: list[Any] = []


def s3_client(moto: MotoServer) -> Any:
    import botocore.session

    if not _SESSION:  # making a session costs 0.3 s: one for the module
        _SESSION.append(botocore.session.get_session())
    return _SESSION[0].create_client(
        "s3",
        endpoint_url=moto.endpoint_url,
        region_name=moto.region,
        aws_access_key_id=moto.access_key,
        aws_secret_access_key=moto.secret_key,
    )


def obj_config(moto: MotoServer, bucket: str, prefix: str = "kv", **options: Any) -> NixlConfig:
    return NixlConfig(
        path=prefix,
        bucket=bucket,
        plugin=NixlPlugin.OBJ,
        endpoint_url=moto.endpoint_url,
        access_key=moto.access_key,
        secret_key=moto.secret_key,
        **options,
    )


def new_bucket(moto: MotoServer) -> str:
    name = f"nixl-{uuid.uuid4().hex[:16]}"
    client = s3_client(moto)
    client.create_bucket(Bucket=name)
    client.close()
    return name


# ----- the conformance suite ----------------------------------------------------------------
class TestNixlPosixConformance(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await open_posix(location)

    # Raw hooks: one file per key, directly in the store's directory.
    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        path = pathlib.Path(backend.config.path, key)  # type: ignore[attr-defined]
        return path.read_bytes() if path.exists() else None

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        path = pathlib.Path(backend.config.path, key)  # type: ignore[attr-defined]
        tmp = path.with_name(f".{key}.raw.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # published whole, as the backend's own writer does

    @pytest.mark.slow  # every step moves data through NIXL's agent and a worker thread
    def test_matches_reference_model(self, tmp_path: pathlib.Path) -> None:
        super().test_matches_reference_model(tmp_path)


class TestNixlObjConformance(BackendConformanceTests):
    # moto moves ~100 MiB/s: 8 MiB still crosses the 4 MiB staging region below (an
    # oversize transfer), and keeps the module's run time small.
    large_object_bytes = 8 << 20
    state_machine_examples = 10
    mtime_slack_s = 5.0

    @pytest.fixture(autouse=True)
    def _service(self, moto: MotoServer) -> None:
        self.moto = moto
        self.buckets: dict[pathlib.Path, str] = {}

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        # One bucket per location: reopening the location finds the same objects.
        bucket = self.buckets.get(location)
        if bucket is None:
            bucket = self.buckets[location] = await asyncio.to_thread(new_bucket, self.moto)
        return await NixlBackend.open(obj_config(self.moto, bucket, staging_bytes=4 << 20))

    # Raw hooks: the S3 objects, through a botocore client of the test's own.
    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        cfg = backend.config  # type: ignore[attr-defined]
        client = s3_client(self.moto)
        try:
            body = client.get_object(Bucket=cfg.bucket, Key=f"{cfg.prefix}/{key}")["Body"]
            return bytes(body.read())
        except client.exceptions.NoSuchKey:
            return None
        finally:
            client.close()

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        cfg = backend.config  # type: ignore[attr-defined]
        client = s3_client(self.moto)
        try:
            client.put_object(Bucket=cfg.bucket, Key=f"{cfg.prefix}/{key}", Body=data)
        finally:
            client.close()

    @pytest.mark.slow  # a few hundred requests to the moto server
    def test_matches_reference_model(self, tmp_path: pathlib.Path) -> None:
        super().test_matches_reference_model(tmp_path)


# ----- configuration, loading and errors ----------------------------------------------------
def test_config_from_url_and_registry() -> None:
    cls, _ = default_registry.resolve_url("nixl:///var/cache/kv?plugin=posix")
    assert cls is NixlBackend
    cfg = NixlBackend.config_from_url("nixl:///var/cache/k%20v?plugin=posix&fsync=true", {})
    assert (cfg.path, cfg.plugin, cfg.fsync) == ("/var/cache/k v", NixlPlugin.POSIX, True)
    url = "nixl://bkt/a/b?plugin=obj&endpoint_url=http://h:1&access_key=AK&secret_key=SEKRET"
    obj = NixlBackend.config_from_url(url, {"posix_queue": "uring"})
    assert (obj.bucket, obj.prefix, obj.endpoint_url) == ("bkt", "a/b", "http://h:1")
    assert obj.posix_queue is PosixQueue.URING
    assert "SEKRET" not in repr(obj) and "AK" not in repr(obj)
    for bad in (
        "nixl://host/x?plugin=posix",
        "nixl://?plugin=posix",
        "nixl:///x?plugin=obj",
        "nixl://b/x?plugin=obj&access_key=a",
        "nixl:///x?plugin=gds",
        "nixl:///x?batch_keys=0",
        "nixl://b1/p?plugin=obj&bucket=b2",  # the location's bucket, given again
    ):
        with pytest.raises(ConfigError):
            NixlBackend.config_from_url(bad, {})
    with pytest.raises(ConfigError, match=r"path twice: '/var/a' .* '/var/b'"):
        NixlBackend.config_from_url("nixl:///var/a?path=/var/b", {})


async def test_open_by_url(tmp_path: pathlib.Path) -> None:
    backend = await open_backend(f"nixl://{tmp_path}/s?plugin=posix&posix_queue=aio")
    assert isinstance(backend, NixlBackend)
    assert await backend.put(["k"], [b"value"]) == [True]
    assert (tmp_path / "s" / "k").read_bytes() == b"value"
    await backend.close()


def test_plugin_that_cannot_load_is_a_typed_error() -> None:
    agent = _API.nixl_agent(f"t-{uuid.uuid4().hex[:8]}", _API.nixl_agent_config(backends=[]))
    with pytest.raises(NixlPluginError) as info:
        create_plugin(agent, "GDS", {})  # listed, but needs CUDA and cuFile
    message = str(info.value)
    assert "'GDS' could not be loaded" in message and "cuFile" in message
    assert "available plugins:" in message and "POSIX" in message
    with pytest.raises(NixlPluginError, match="'NOPE' could not be loaded: it is not installed"):
        create_plugin(agent, "NOPE", {"secret_key": "SEKRET"})
    assert isinstance(info.value, BackendUnavailableError)


async def test_missing_nixl_package_names_the_extra(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("nixl_cu12._api", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"pip install 'hicache\[nixl\]'"):
        await open_posix(tmp_path / "s")


async def test_unusable_root_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(BackendUnavailableError, match="unusable"):
        await open_posix(tmp_path / "file")


async def test_posix_store_never_follows_a_linked_object(
    store: NixlBackend, tmp_path: pathlib.Path
) -> None:
    """A key is one path component: the attack is an object that is a link to a file outside.
    It is no object; a put replaces the link, not its target."""
    (tmp_path / "outside").write_bytes(b"outside the store")
    link = tmp_path / "store" / "k"
    link.symlink_to(tmp_path / "outside")
    assert await store.exists(["k"]) == [False] and await store.get(["k"]) == [None]
    assert [info async for info in store.scan()] == []
    assert await store.delete(["k"]) == [False] and link.is_symlink()
    assert await store.put(["k"], [b"mine"]) == [True] and not link.is_symlink()
    assert (tmp_path / "outside").read_bytes() == b"outside the store"


# ----- registered memory ----------------------------------------------------------------------
async def test_registered_memory_is_zero_copy(store: NixlBackend) -> None:
    pool = np.frombuffer(os.urandom(8 * 65536), np.uint8).copy()  # a host pool of 8 pages
    assert store.register_memory(pool) is True
    assert store.register_memory(pool[65536:]) is False  # already inside
    pages = [pool[i * 65536 : (i + 1) * 65536] for i in range(8)]
    keys = [f"page-{i}" for i in range(8)]
    assert await store.put(keys, pages) == [True] * 8
    before = await store.stats()
    assert before["zero_copy_bytes"] == 8 * 65536 and before["bytes_staged"] == 0
    expected = pool.copy()
    pool[:] = 0
    assert await store.get_into(keys[::-1], pages[::-1]) == [65536] * 8
    assert np.array_equal(pool, expected)
    after = await store.stats()
    assert after["zero_copy_bytes"] == 16 * 65536 and after["bytes_staged"] == 0
    assert after["registered_bytes"] == pool.nbytes
    # Outside the registered pool: staged, and still correct.
    outside = bytearray(65536)
    assert await store.get_into(["page-3"], [outside]) == [65536]
    assert bytes(outside) == expected[3 * 65536 : 4 * 65536].tobytes()
    assert (await store.stats())["bytes_staged"] == 65536
    assert store.unregister_memory(pool) is True and store.unregister_memory(pool) is False
    with pytest.raises(InvalidArgumentError):
        store.register_memory(np.zeros(4, np.uint8)[::2])


async def test_part_registered_segments_are_staged(store: NixlBackend) -> None:
    pool = np.zeros(4096, np.uint8)
    store.register_memory(pool)
    outside = np.frombuffer(os.urandom(100), np.uint8)
    pool[:50] = 7
    assert await store.put(["mix"], [[pool[:50], outside]]) == [True]
    assert (await store.stats())["bytes_staged"] == 150
    assert await store.get(["mix"]) == [bytes(pool[:50]) + outside.tobytes()]


async def test_header_and_page_in_registered_memory_move_zero_copy(store: NixlBackend) -> None:
    size = 65536
    pool = np.frombuffer(os.urandom(8 * size), np.uint8).copy()  # pages 0-3 written, 4-7 read
    arena = np.frombuffer(os.urandom(8 * 160), np.uint8).copy()  # one header slot per page
    assert store.register_memory(pool) and store.register_memory(arena)

    def page(i: int) -> list[np.ndarray]:
        return [arena[i * 160 : (i + 1) * 160], pool[i * size : (i + 1) * size]]

    keys = [f"page-{i}" for i in range(4)]
    assert await store.put(keys, [page(i) for i in range(4)]) == [True] * 4
    assert await store.get_into(keys, [page(4 + i) for i in range(4)]) == [160 + size] * 4
    assert np.array_equal(pool[4 * size :], pool[: 4 * size])
    assert np.array_equal(arena[640:], arena[:640])
    stats = await store.stats()
    assert stats["bytes_staged"] == 0 and stats["zero_copy_bytes"] == 8 * (160 + size)
    # The same two segments outside registered memory: staged both ways, and counted.
    plain = [bytearray(arena[:160]), bytearray(pool[:size])]
    assert await store.put(["plain"], [plain]) == [True]
    out = [bytearray(160), bytearray(size)]
    assert await store.get_into(["plain"], [out]) == [160 + size] and out == plain
    assert (await store.stats())["bytes_staged"] == 2 * (160 + size)


async def test_staging_rounds_and_oversize_objects(tmp_path: pathlib.Path) -> None:
    backend = await open_posix(tmp_path / "s", staging_bytes=10000, batch_keys=5)
    values = [os.urandom(n) for n in (3000, 4000, 5000, 25000, 1, 0, 9999)]
    keys = [f"v{i}" for i in range(len(values))]
    assert await backend.put(keys, values) == [True] * len(values)
    assert await backend.get(keys, size_hint=30000) == values
    stats = await backend.stats()
    assert stats["oversize_transfers"] == 2  # the 25000-byte object, written and read
    assert stats["transfers"] >= 8 and stats["transfer_failures"] == 0
    await backend.close()


# ----- behaviour of transfers -----------------------------------------------------------------
async def test_transfers_do_not_block_the_loop(store: NixlBackend) -> None:
    size = 32 << 20
    data = np.frombuffer(os.urandom(size), np.uint8)
    assert await store.put(["big"], [data]) == [True]
    out = np.empty(size, np.uint8)
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    for _ in range(3):
        assert await store.get_into(["big"], [out]) == [size]
    elapsed = time.perf_counter() - start
    task.cancel()
    during = [t for t in ticks if t >= start]
    gaps = np.diff(during)
    assert np.array_equal(out, data)
    # The loop kept running while three 32 MiB reads moved: many ticks, no long stall.
    assert len(during) >= 10, (len(during), elapsed)
    assert gaps.max() < max(0.05, elapsed / 4), gaps.max()


async def test_fsync_option_and_atomic_publish(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    backend = await open_posix(tmp_path / "s", fsync=True)
    assert await backend.put(["k"], [b"durable"]) == [True]
    assert len(synced) >= 2  # the file before its rename, the directory after
    assert sorted(os.listdir(tmp_path / "s")) == ["k"]  # no temporary file left
    await backend.close()


async def test_failed_transfer_fails_only_its_key(
    store: NixlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await store.put(["a", "b"], [b"aa", b"bb"]) == [True, True]
    agent = store._agent
    assert agent is not None
    real = agent.transfer

    def flaky(op: str, local: Any, remote: Any, mem: str) -> bool:
        return len(local) == 1 and local[0][1] != 3 and real(op, local, remote, mem)

    monkeypatch.setattr(agent, "transfer", flaky)  # batches fail; alone, 3-byte objects fail
    assert await store.put(["c", "d"], [b"ccc", b"dddd"]) == [False, True]
    assert await store.get_into(["a", "b"], [bytearray(2), bytearray(2)]) == [2, 2]
    monkeypatch.setattr(agent, "transfer", lambda *a: False)
    assert await store.get_into(["a", "zz"], [bytearray(2), bytearray(2)]) == [MISS, MISS]
    monkeypatch.undo()
    assert await store.exists(["c", "d"]) == [False, True]
    assert sorted(os.listdir(store.config.path)) == ["a", "b", "d"]  # no temporary leftovers
    assert (await store.stats())["read_errors"] == 1


# ----- OBJ specifics ----------------------------------------------------------------------------
async def test_obj_objects_visible_through_s3(moto: MotoServer) -> None:
    bucket = await asyncio.to_thread(new_bucket, moto)
    url = (
        f"nixl://{bucket}/ns/v1?plugin=obj&endpoint_url={moto.endpoint_url}"
        f"&access_key={moto.access_key}&secret_key={moto.secret_key}"
    )
    backend = await open_backend(url)
    assert isinstance(backend, NixlBackend) and backend.config.prefix == "ns/v1"
    pool = np.frombuffer(os.urandom(1 << 20), np.uint8).copy()
    backend.register_memory(pool)
    assert await backend.put(["p0", "p1"], [pool[: 1 << 19], pool[1 << 19 :]]) == [True, True]
    assert (await backend.stats())["zero_copy_bytes"] == 1 << 20
    client = s3_client(moto)
    head = client.head_object(Bucket=bucket, Key="ns/v1/p1")
    assert head["ContentLength"] == 1 << 19
    client.put_object(Bucket=bucket, Key="ns/v1/foreign", Body=b"from elsewhere")
    client.close()
    # A key this process never wrote: its size comes from S3.
    assert await backend.get(["foreign"]) == [b"from elsewhere"]
    assert repr(backend.config).count("testing") == 0
    await backend.close()


async def test_obj_bucket_missing_is_unavailable(moto: MotoServer) -> None:
    with pytest.raises(BackendUnavailableError, match="create the bucket") as info:
        await NixlBackend.open(obj_config(moto, "no-such-bucket-here"))
    assert moto.secret_key not in str(info.value)


async def test_obj_object_deleted_elsewhere_reads_as_miss(moto: MotoServer) -> None:
    bucket = await asyncio.to_thread(new_bucket, moto)
    backend = await NixlBackend.open(obj_config(moto, bucket))
    assert await backend.put(["gone", "kept"], [b"x" * 100, b"y" * 50]) == [True, True]
    client = s3_client(moto)
    client.delete_object(Bucket=bucket, Key="kv/gone")  # the size index still knows "gone"
    client.close()
    bufs = [bytearray(100), bytearray(50)]
    assert await backend.get_into(["gone", "kept"], bufs) == [MISS, 50]
    assert bytes(bufs[1]) == b"y" * 50
    assert await backend.get(["gone"]) == [None]
    await backend.close()


# ----- polling pace -----------------------------------------------------------------------------
def test_pacer_sleeps_most_of_the_expected_time_and_learns_rates_asymmetrically() -> None:
    from hicache.backends.nixl.agent import TransferPacer

    pacer = TransferPacer()
    mib64 = 64 << 20
    assert pacer.first_wait("READ", mib64) == 0.0  # nothing seen yet: poll from the start
    pacer.record("READ", mib64, 0.008)  # 8 ms for 64 MiB
    assert pacer.first_wait("READ", mib64) == pytest.approx(0.75 * 0.008)
    assert pacer.first_wait("WRITE", mib64) == 0.0  # rates are per direction
    pacer.record("READ", mib64, 0.004)  # faster: believed at once
    assert pacer.first_wait("READ", mib64) == pytest.approx(0.75 * 0.004)
    pacer.record("READ", mib64, 0.040)  # much slower: followed a fifth of the way
    rate = (mib64 / 0.004) + 0.2 * (mib64 / 0.040 - mib64 / 0.004)
    assert pacer.first_wait("READ", mib64) == pytest.approx(0.75 * mib64 / rate)
    pacer.record("READ", 4096, 1.0)  # a small transfer is fixed cost: no sample
    pacer.record("READ", mib64, 0.0)
    assert pacer.first_wait("READ", mib64) == pytest.approx(0.75 * mib64 / rate)
    assert pacer.first_wait("READ", 4096) == 0.0  # and small ones are polled from the start
