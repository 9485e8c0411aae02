"""The fsspec backend: the conformance suite on moto S3, fsspec's memory store and local files,
then what only a remote object store gets wrong (URLs, credentials, endpoints, outages).

Moto accepts any credentials unless its IAM checks are on (``INITIAL_NO_AUTH_ACTION_COUNT=0``
in the server's environment, which then refuses every key it has no IAM user for): the
wrong-credentials test starts its own server that way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import pathlib
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import fsspec
import pytest

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.fsspec import FsspecBackend, FsspecConfig
from hicache.backends.fsspec.ops import filesystem
from hicache.backends.registry import BackendRegistry, open_backend
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import BackendLoadError, BackendUnavailableError, ConfigError
from hicache.tools.services.moto import MotoServer, moto_server
from hicache.tools.services.process import free_port


def s3_url(server: MotoServer, root: str, **options: Any) -> str:
    query = {"endpoint_url": server.endpoint_url, "key": server.access_key}
    query |= {"secret": server.secret_key, **options}
    return f"s3://{root}?" + "&".join(f"{k}={quote(str(v), safe='')}" for k, v in query.items())


def raw_fs(server: MotoServer) -> Any:
    """A plain s3fs client on the server: ground truth beside the backend."""
    s3fs = pytest.importorskip("s3fs")
    return s3fs.S3FileSystem(
        key=server.access_key,
        secret=server.secret_key,
        endpoint_url=server.endpoint_url,
        skip_instance_cache=True,
        use_listings_cache=False,
    )


def new_bucket(server: MotoServer) -> str:
    name = f"hc-{uuid.uuid4().hex[:16]}"
    raw_fs(server).mkdir(name)
    return name


def short_hash(location: pathlib.Path) -> str:
    return hashlib.sha1(str(location).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def s3(moto_s3: MotoServer) -> MotoServer:
    """The session's moto server, where s3fs is installed to talk to it."""
    pytest.importorskip("s3fs")
    return moto_s3


@pytest.fixture(scope="module")
def bucket(s3: MotoServer) -> str:
    """One bucket for this module; each test works under a prefix of its own."""
    return new_bucket(s3)


# ----- the conformance suite ----------------------------------------------------------------
class _RawThroughFsspec(BackendConformanceTests):
    """Raw hooks through a filesystem of the backend's protocol that the backend does not use."""

    # moto moves about 100 MiB/s on this machine; 16 MiB keeps the module fast.
    large_object_bytes = 16 << 20

    def raw_fs(self) -> Any:
        raise NotImplementedError

    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        path = f"{backend.config.root}/{key}"  # type: ignore[attr-defined]
        try:
            data: bytes = self.raw_fs().cat_file(path)
        except FileNotFoundError:
            return None
        return data

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        self.raw_fs().pipe_file(f"{backend.config.root}/{key}", data)  # type: ignore[attr-defined]


class TestS3Conformance(_RawThroughFsspec):
    @pytest.fixture(autouse=True)
    def _server(self, s3: MotoServer, bucket: str) -> None:
        self.server, self.bucket = s3, bucket
        self._fs: Any = None

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        root = f"{self.bucket}/conformance/{short_hash(location)}"
        return await open_backend(s3_url(self.server, root))

    def raw_fs(self) -> Any:
        if self._fs is None:  # a client of its own, with no listing cache, for the test
            self._fs = raw_fs(self.server)
        return self._fs

    @pytest.mark.slow  # a few hundred requests to the moto server
    def test_matches_reference_model(self, tmp_path: pathlib.Path) -> None:
        super().test_matches_reference_model(tmp_path)


class TestMemoryConformance(_RawThroughFsspec):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await FsspecBackend.open(FsspecConfig("memory", self._root(location)))

    def raw_fs(self) -> Any:
        return fsspec.filesystem("memory")  # one store per process, which the backend uses too

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        fs = fsspec.filesystem("memory")
        if fs.exists(self._root(location)):
            fs.rm(self._root(location), recursive=True)

    def _root(self, location: pathlib.Path) -> str:
        return f"/hicache-tests/{short_hash(location)}"


class TestLocalFileConformance(_RawThroughFsspec):
    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await open_backend(f"fsspec+file://{location}")

    def raw_fs(self) -> Any:
        return fsspec.filesystem("file")


# ----- URLs and configuration -----------------------------------------------------------------
def test_url_fields_query_options_and_overrides() -> None:
    url = (
        "s3://bkt/a/b/?endpoint_url=http%3A//127.0.0.1%3A9000&key=AK&secret=SK"
        "&region=eu-west-1&max_concurrency=8&retries=0&anon=false&create_bucket=true"
    )
    config = FsspecBackend.config_from_url(url, {"connect_timeout_s": 1})
    assert config == FsspecConfig(
        protocol="s3",
        root="bkt/a/b",
        endpoint_url="http://127.0.0.1:9000",
        key="AK",
        secret="SK",
        region="eu-west-1",
        max_concurrency=8,
        retries=0,
        create_bucket=True,
        connect_timeout_s=1.0,
    )
    options = {"storage_options": {"client_kwargs": {"verify": False}}}
    config = FsspecBackend.config_from_url("s3a://bkt", options)
    assert (config.protocol, config.root) == ("s3a", "bkt")
    assert config.extra_options() == {"client_kwargs": {"verify": False}}


def test_storage_options_merge_over_the_typed_fields() -> None:
    pytest.importorskip("s3fs")
    options = {"config_kwargs": {"max_pool_connections": 5}, "requester_pays": True}
    config = FsspecBackend.config_from_url(
        "s3://bkt/x?region=eu-west-1&connect_timeout_s=2", {"storage_options": options}
    )
    fs = filesystem(config)
    assert fs.config_kwargs["max_pool_connections"] == 5
    assert fs.config_kwargs["connect_timeout"] == 2.0  # the typed field survives the merge
    assert fs.client_kwargs == {"region_name": "eu-west-1"} and fs.requester_pays


def test_explicit_fsspec_urls_resolve_through_the_registry() -> None:
    registry = BackendRegistry(group=None)
    for url in ("s3://bucket/x", "s3a://bucket/x", "gs://bucket/x", "az://container/x"):
        assert registry.resolve_url(url) == (FsspecBackend, url)
    cls, inner = registry.resolve_url("fsspec+memory://name/x")
    assert (cls, inner) == (FsspecBackend, "memory://name/x")
    config = cls.config_from_url(inner, {})
    assert (config.protocol, config.root) == ("memory", "name/x")
    config = cls.config_from_url(registry.resolve_url("fsspec+file:///tmp/st/")[1], {})
    assert (config.protocol, config.root) == ("file", "/tmp/st")


def test_cli_lists_the_backend(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.tools.cli import main

    assert main(["backends", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    row = rows["fsspec"]
    assert row["available"] is True, row.get("error")
    assert {"s3", "s3a", "gs", "gcs", "az", "abfs"} <= set(row["schemes"])
    assert row["capabilities"][:2] == ["persistent", "shared_across_processes"]


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("s3://", "needs a bucket"),
        ("s3:///prefix-only/", "needs a bucket"),
        ("fsspec+memory://", "needs a path"),
        ("s3://bkt?max_concurrency=0", "max_concurrency"),
        ("s3://bkt?storage_options=[1]", "JSON object"),
        ("s3://bkt?retries=-1", "retries"),
        ("fsspec+memory://x?key=AK", "S3 options"),
        ("fsspec+nosuchproto://x", "no protocol"),
    ],
)
async def test_bad_config_is_refused(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        await open_backend(url)


async def test_no_credentials_is_reported_as_such(s3: MotoServer) -> None:
    url = f"s3://bkt/x?endpoint_url={s3.endpoint_url}"
    with pytest.MonkeyPatch.context() as mp:  # no credentials from the environment either
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        with pytest.raises(BackendUnavailableError, match="no usable credentials"):
            await open_backend(url)


def test_secrets_stay_out_of_errors_and_repr() -> None:
    with pytest.raises(ConfigError) as info:
        FsspecBackend.config_from_url("s3://AKSECRET:SKSECRET@bkt/x", {})
    assert "SECRET" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        FsspecBackend.config_from_url("s3://bkt?storage_options=SKSECRET", {})
    assert "SECRET" not in str(info.value) and "JSON object" in str(info.value)
    config = FsspecConfig(
        "s3",
        "bkt/x",
        key="AKSECRET",
        secret="SKSECRET",
        token="TKSECRET",
        storage_options='{"password": "PWSECRET"}',
    )
    for text in (repr(config), str(config), f"{config}", repr([config])):
        assert "SECRET" not in text
        assert "secret='***'" in text and "'password': ***" in text and "root='bkt/x'" in text


# ----- S3 specifics ---------------------------------------------------------------------------
async def test_objects_live_under_the_prefix(s3: MotoServer, bucket: str) -> None:
    fs = raw_fs(s3)
    root = f"{bucket}/layout-{uuid.uuid4().hex[:8]}"
    async with await open_backend(s3_url(s3, root)) as backend:
        assert await backend.put(["k1", "k2"], [b"one", [b"tw", b"o"]]) == [True, True]
        assert fs.cat_file(f"{root}/k1") == b"one" and fs.cat_file(f"{root}/k2") == b"two"
        assert (await backend.stats())["bytes_staged"] == 6  # each body is joined into bytes
        fs.pipe_file(f"{root}/from-raw", b"raw!")
        fs.pipe_file(f"{root}/nested/deeper", b"another store's")  # not a key of this store
        assert await backend.get(["from-raw"]) == [b"raw!"]
        assert (await backend.stats())["bytes_staged"] == 10  # and each read comes as bytes
        listed = sorted([i.key async for i in backend.scan()])
        assert listed == ["from-raw", "k1", "k2"]
        assert await backend.delete(["k1", "nested"]) == [True, False]
        assert not fs.exists(f"{root}/k1") and fs.exists(f"{root}/nested/deeper")


async def test_usable_from_another_event_loop(s3: MotoServer, bucket: str) -> None:
    # Requests run on fsspec's IO loop, so the loop that opened the backend does not matter.
    url = s3_url(s3, f"{bucket}/loops")
    backend = await asyncio.to_thread(asyncio.run, open_backend(url))
    try:
        work = backend.put(["x"], [b"from another loop"])
        assert await asyncio.to_thread(asyncio.run, work) == [True]
        assert await backend.get(["x"]) == [b"from another loop"]
    finally:
        await backend.close()


async def test_missing_bucket_fails_at_open_or_is_created(s3: MotoServer) -> None:
    name = f"hc-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(BackendUnavailableError, match=r"does not exist.*create_bucket=true"):
        await open_backend(s3_url(s3, f"{name}/x"))
    async with await open_backend(s3_url(s3, f"{name}/x", create_bucket="true")) as b:
        assert await b.put(["k"], [b"v"]) == [True]
    assert raw_fs(s3).cat_file(f"{name}/x/k") == b"v"


async def test_unreachable_endpoint_fails_fast_at_open() -> None:
    pytest.importorskip("s3fs")
    url = f"s3://bkt/x?endpoint_url=http://127.0.0.1:{free_port()}&key=k&secret=s"
    start = time.monotonic()
    with pytest.raises(BackendUnavailableError, match=r"cannot reach.*check endpoint_url"):
        await open_backend(url)
    assert time.monotonic() - start < 10


async def test_wrong_credentials_fail_at_open(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # the server checks every key
    with moto_server(str(tmp_path / "moto.log")) as server:
        with pytest.raises(
            BackendUnavailableError, match=r"access refused.*key and secret"
        ) as info:
            await open_backend(s3_url(server, "bkt/x"))
        assert server.secret_key not in str(info.value)


async def test_missing_s3fs_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now raises ImportError
    # fsspec remembers classes it imported; the module (not fsspec.registry, a mapping) has it.
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    with pytest.raises(BackendLoadError, match=r"pip install 'hicache\[s3\]'"):
        await open_backend("s3://bkt/x")


async def test_failures_are_counted_and_credentials_never_logged(
    s3: MotoServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    caplog.set_level(logging.DEBUG, logger="hicache")
    name = new_bucket(s3)
    url = s3_url(s3, f"{name}/x").replace("secret=testing", "secret=SKMARKER")
    async with await open_backend(url) as backend:
        assert await backend.put(["k"], [b"v"]) == [True]
        raw_fs(s3).rm(name, recursive=True)  # the bucket goes away under the backend
        assert await backend.put(["k", "j"], [b"v", b"w"]) == [False, False]
        assert await backend.get_into(["k"], [bytearray(1)]) == [MISS]  # NoSuchBucket: a miss
        stats = await backend.stats()
        text = repr(backend.config) + str(stats)
    assert stats["put_failures"] == 2 and stats["put_errors"] == 2 and stats["errors"] == 2
    assert any("put on s3://" in r.getMessage() for r in caplog.records), caplog.text
    assert "SKMARKER" not in caplog.text + text


@pytest.fixture
async def own_server(tmp_path: pathlib.Path) -> AsyncIterator[MotoServer]:
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    with moto_server(str(tmp_path / "moto.log")) as server:
        yield server


async def test_server_killed_mid_run_gives_misses_and_counters(own_server: MotoServer) -> None:
    name = new_bucket(own_server)
    url = s3_url(own_server, f"{name}/x", retries=0, connect_timeout_s=1)
    backend = await open_backend(url)
    try:
        assert await backend.put(["a", "b"], [b"1", b"2"]) == [True, True]
        own_server.process.kill()
        assert await backend.put(["a", "c"], [b"x", b"y"]) == [False, False]
        assert await backend.get_into(["a", "b"], [bytearray(1), bytearray(1)]) == [MISS, MISS]
        assert await backend.exists(["a"]) == [False]
        assert await backend.delete(["b"]) == [False]
        assert await backend.peek(["a"], 1) == [None]
        with pytest.raises(BackendUnavailableError, match="listing"):
            [i async for i in backend.scan()]
        stats = await backend.stats()
    finally:
        await backend.close()
    assert stats["put_failures"] == 2 and stats["get_misses"] == 2
    expected = {"put_errors": 2, "read_errors": 3, "exists_errors": 1, "delete_errors": 1}
    assert {k: stats[k] for k in expected} == expected
    assert stats["scan_errors"] == 1 and stats["errors"] == 8


# ----- file-like targets ------------------------------------------------------------------------
async def test_file_writes_go_through_a_temporary_name(tmp_path: pathlib.Path) -> None:
    async with await open_backend(f"fsspec+file://{tmp_path}/store") as backend:
        assert await backend.put(["a", "b"], [b"1" * 10, b""]) == [True, True]
        assert await backend.put(["a"], [b"2" * 5]) == [True]
        assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["a", "b"]
        (tmp_path / "store" / ".a.123.abc.tmp").write_bytes(b"torn")  # a crashed writer's
        assert sorted([i.key async for i in backend.scan()]) == ["a", "b"]
        assert await backend.get(["a"]) == [b"2" * 5]


def test_memory_store_is_not_persistent() -> None:
    backend = FsspecBackend(FsspecConfig("memory", "/x"), None)  # type: ignore[arg-type]
    assert not backend.capabilities.persistent and FsspecBackend.capabilities.persistent


# ----- the benchmark's raw baseline -------------------------------------------------------------
async def test_bench_baseline_moves_the_same_bytes(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    import numpy as np

    from hicache.tools.bench.stores.backends import _Workload
    from hicache.tools.bench.stores.raw_fsspec import provision, raw_baseline

    source = np.random.default_rng(1).integers(0, 256, size=(40, 4096), dtype=np.uint8)
    work = _Workload([f"bench-{i}" for i in range(40)], source, np.zeros_like(source))
    with provision(str(tmp_path), source.nbytes) as url:
        async with await open_backend(url) as backend:
            put, get = raw_baseline(backend, str(tmp_path), work)
            for lo in range(0, 40, 32):  # batches of 32, as the bench moves them
                await asyncio.to_thread(put, work, lo, min(lo + 32, 40))
                await asyncio.to_thread(get, work, lo, min(lo + 32, 40))
            assert np.array_equal(work.dest, work.source)
            # Beside the backend's objects, never among them.
            assert [i async for i in backend.scan()] == []
