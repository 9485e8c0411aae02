"""How the fsspec backend talks to one filesystem: building the client, plain fsspec calls,
and S3 fast paths.

Every coroutine here runs on fsspec's IO loop (the backend hands whole batches over) and deals
in bytes and paths only: it never touches a caller's buffer, so a cancelled batch can simply be
abandoned. ``FsOps`` works for any fsspec filesystem (sync ones arrive wrapped in
``AsyncFileSystemWrapper``); ``ObjectStoreOps`` adds the bucket checks of object stores;
``S3Ops`` calls S3 directly where s3fs's generic methods cost a second request per key (a miss
in ``_info`` lists the "directory", ``_cat_file`` asks for the size first).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import functools
import os
import random
from typing import Any

import fsspec
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

from hicache.backends.base import MISS, ObjectInfo
from hicache.backends.fsspec.config import OBJECT_STORES, S3_PROTOCOLS, FsspecConfig
from hicache.errors import BackendLoadError, BackendUnavailableError, ConfigError

__all__ = [
    "FsOps",
    "ObjectStoreOps",
    "S3Ops",
    "filesystem",
    "open_error",
]

_INSTALL_HINTS = {
    **dict.fromkeys(S3_PROTOCOLS, "pip install 'hicache[s3]'"),
    **dict.fromkeys(("gs", "gcs"), "pip install gcsfs"),
    **dict.fromkeys(("az", "abfs", "abfss", "adl"), "pip install adlfs"),
}
_TMP_KEY_CHARS = 200  # a temporary name stays under NAME_MAX for 250-character keys
_DELETE_BATCH = 1000  # the most keys one S3 DeleteObjects call takes
_MTIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "created", "timeCreated")


def filesystem(config: FsspecConfig) -> Any:
    """A fresh async filesystem for ``config`` (never fsspec's shared cached instance)."""
    try:
        cls = fsspec.get_filesystem_class(config.protocol)
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(config.protocol, "install the fsspec implementation")
        raise BackendLoadError(
            f"the {config.protocol}:// filesystem is not installed ({exc}); {hint}"
        ) from None
    except ValueError:
        raise ConfigError(f"fsspec knows no protocol {config.protocol!r}") from None
    options = _options(config)
    try:
        if getattr(cls, "async_impl", False):
            fs = cls(asynchronous=True, skip_instance_cache=True, **options)
        else:
            sync_fs = cls(skip_instance_cache=True, **options)
            return AsyncFileSystemWrapper(sync_fs, asynchronous=True)
    except TypeError as exc:  # an option the implementation does not take; names, no values
        raise ConfigError(f"{cls.__name__} refused an option: {exc}") from None
    if config.protocol in S3_PROTOCOLS:
        fs.retries = 1  # botocore already retries; s3fs's own loop would multiply the attempts
    return fs


def _options(config: FsspecConfig) -> dict[str, Any]:
    """The filesystem's constructor options: the typed fields, then ``storage_options``."""
    extra = config.extra_options()
    if config.protocol in S3_PROTOCOLS:
        return _s3_options(config, extra)
    options: dict[str, Any] = {"endpoint_url": config.endpoint_url, "token": config.token}
    options = {k: v for k, v in options.items() if v is not None}
    if config.anon:
        options["anon"] = True
    if config.protocol in OBJECT_STORES:
        options["use_listings_cache"] = False
    return {**options, **extra}


def _s3_options(config: FsspecConfig, extra: dict[str, Any]) -> dict[str, Any]:
    typed = {
        "endpoint_url": config.endpoint_url,
        "key": config.key,
        "secret": config.secret,
        "token": config.token,
    }
    options: dict[str, Any] = {k: v for k, v in typed.items() if v is not None}
    options.update(anon=config.anon, use_listings_cache=False)
    # Shared only where the client gets all it needs from these options: extra options may
    # be session options (profile=...), and the environment's credentials are resolved and
    # kept by a session, so a later open with other credentials in the environment needs its own.
    if not extra and (config.anon or (config.key and config.secret)):
        options["session"] = _shared_session()
    client = {"region_name": config.region} if config.region else {}
    botocore = {
        "connect_timeout": config.connect_timeout_s,
        "read_timeout": config.read_timeout_s,
        "retries": {"total_max_attempts": config.retries + 1, "mode": "standard"},
        # botocore's default pool of 10 connections would cap the concurrency.
        "max_pool_connections": config.max_concurrency,
    }
    options["client_kwargs"] = {**client, **extra.pop("client_kwargs", {})}
    options["config_kwargs"] = {**botocore, **extra.pop("config_kwargs", {})}
    return {**options, **extra}


@functools.cache
def _shared_session() -> Any:
    """One botocore session for the S3 backends of this process.

    Creating a session loads the S3 service model, about 0.2 s, which would otherwise be most
    of the time an open takes. The credentials are the client's, never the session's.
    """
    from aiobotocore.session import AioSession

    return AioSession()


def open_error(exc: BaseException, config: FsspecConfig) -> BackendUnavailableError:
    """The typed error for a failed open-time probe, saying what to fix (never credentials)."""
    where = f"{config.protocol}://{config.root}"
    at = f" at {config.endpoint_url}" if config.endpoint_url else ""
    detail = f"{type(exc).__name__}: {exc}"
    if config.protocol not in OBJECT_STORES:
        return BackendUnavailableError(
            f"{where} is unusable ({detail}): point the URL at a location this process can "
            "create and write"
        )
    if isinstance(exc, FileNotFoundError):
        return BackendUnavailableError(
            f"{where}: the bucket does not exist{at} ({detail}); create it, fix the URL, "
            "or open with create_bucket=true"
        )
    if "Credentials" in type(exc).__name__:  # botocore's NoCredentialsError and kin
        return BackendUnavailableError(
            f"{where}: no usable credentials ({detail}); pass key and secret (or token), "
            "or anon=true for a public bucket"
        )
    if isinstance(exc, PermissionError):
        return BackendUnavailableError(
            f"{where}: access refused{at} ({detail}); check key and secret (or token, anon) "
            "and that they may list, read and write this bucket"
        )
    return BackendUnavailableError(
        f"{where}: cannot reach the store{at} ({detail}); check endpoint_url, the network "
        "and that the service runs (connect_timeout_s and retries bound how long this takes)"
    )


def _temp_name(key: str) -> str:
    # A leading dot: never a valid key, so scans skip it and no object is ever shadowed.
    return f".{key[:_TMP_KEY_CHARS]}.{os.getpid()}.{random.getrandbits(48):012x}.tmp"


def _mtime(info: dict[str, Any]) -> float:
    for name in _MTIME_FIELDS:
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and value:
            with contextlib.suppress(ValueError):
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0


class FsOps:
    """Objects as files ``root/<key>`` through fsspec's async API.

    ``atomic_writes`` says a single write is published whole (object stores, memory); when
    false, a write goes to a temporary name beside the object and is then moved over it.
    """

    def __init__(self, fs: Any, root: str, atomic_writes: bool, where: str) -> None:
        self.fs = fs
        self.root = root
        self.atomic_writes = atomic_writes
        self.where = where

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    async def probe(self, create_bucket: bool) -> None:
        """Make root exist and prove it writable; raises what fsspec raises."""
        await self.fs._makedirs(self.root, exist_ok=True)
        probe = self.path(_temp_name("probe"))
        await self.fs._pipe_file(probe, b"")
        await self.fs._rm_file(probe)

    async def size(self, key: str) -> int | None:
        """The object's size, None when absent."""
        try:
            info = await self.fs._info(self.path(key))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    async def read(self, key: str, limit: int) -> tuple[int, bytes | None]:
        """(size, bytes) for an object of at most ``limit`` bytes, (size, None) for a larger
        one, (MISS, None) when absent."""
        try:
            data = await self.fs._cat_file(self.path(key))
        except FileNotFoundError:
            return MISS, None
        return len(data), (data if len(data) <= limit else None)

    async def head(self, key: str, nbytes: int) -> bytes | None:
        try:
            data: bytes = await self.fs._cat_file(self.path(key), start=0, end=nbytes)
        except FileNotFoundError:
            return None
        return data

    async def write(self, key: str, data: bytes | bytearray) -> None:
        path = self.path(key)
        if self.atomic_writes:
            await self.fs._pipe_file(path, data)
            return
        tmp = self.path(_temp_name(key))
        try:
            await self.fs._pipe_file(tmp, data)
            await self.fs._mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.fs._rm_file(tmp)
            raise

    async def remove(self, keys: list[str]) -> None:
        """Remove objects known to exist; one already gone is not an error."""

        async def one(key: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                await self.fs._rm_file(self.path(key))

        await asyncio.gather(*(one(k) for k in keys))

    async def list_page(self, prefix: str, token: Any) -> tuple[list[ObjectInfo], Any]:
        """Objects whose key starts with ``prefix``: one page and the token of the next."""
        try:
            entries = await self.fs._ls(self.root, detail=True)
        except FileNotFoundError:
            return [], None
        out = []
        for info in entries:
            key = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "file" and key.startswith(prefix) and key[:1] != ".":
                out.append(ObjectInfo(key, int(info["size"]), _mtime(info)))
        return out, None

    async def close(self) -> None:
        """Release connections; the default has none of its own."""


class ObjectStoreOps(FsOps):
    """A bucket store (gs, az): single writes are atomic, the bucket is checked at open."""

    def __init__(self, fs: Any, root: str, where: str) -> None:
        super().__init__(fs, root, atomic_writes=True, where=where)
        self.bucket, _, prefix = root.partition("/")
        self.prefix = prefix.strip("/")

    async def probe(self, create_bucket: bool) -> None:
        try:
            await self.fs._info(self.bucket)
        except FileNotFoundError:
            if not create_bucket:
                raise
            await self.fs._mkdir(self.bucket)


class S3Ops(ObjectStoreOps):
    """S3 through s3fs's client: one request per key for exists, get and peek."""

    def __init__(self, fs: Any, root: str, where: str, region: str | None) -> None:
        super().__init__(fs, root, where)
        self.region = region

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    async def _call(self, method: str, **kwargs: Any) -> Any:
        return await self.fs._call_s3(method, Bucket=self.bucket, **kwargs)

    async def probe(self, create_bucket: bool) -> None:
        # One cheap listing proves the endpoint, the credentials and the bucket at once.
        listing = {"Prefix": self._key(""), "MaxKeys": 1}
        try:
            await self._call("list_objects_v2", **listing)
        except FileNotFoundError:
            if not create_bucket:
                raise
            await self._create_bucket()
            await self._call("list_objects_v2", **listing)

    async def _create_bucket(self) -> None:
        params: dict[str, Any] = {}
        # us-east-1 is the default location and refuses to be named as a constraint.
        if self.region and self.region != "us-east-1":
            params["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        with contextlib.suppress(FileExistsError):  # another opener won the race
            await self._call("create_bucket", **params)

    async def size(self, key: str) -> int | None:
        try:
            out = await self._call("head_object", Key=self._key(key))
        except FileNotFoundError:
            return None
        return int(out["ContentLength"])

    async def read(self, key: str, limit: int) -> tuple[int, bytes | None]:
        try:
            out = await self._call("get_object", Key=self._key(key))
        except FileNotFoundError:
            return MISS, None
        body = out["Body"]
        try:
            size = int(out["ContentLength"])
            if size > limit:  # the size is all the caller gets: do not download the body
                return size, None
            data: bytes = await body.read()
        finally:
            body.close()
        if len(data) != size:
            raise OSError(errno.EIO, f"short read of {key!r}: {len(data)} of {size} bytes")
        return size, data

    async def head(self, key: str, nbytes: int) -> bytes | None:
        if nbytes == 0:
            return None if await self.size(key) is None else b""
        try:
            out = await self._call("get_object", Key=self._key(key), Range=f"bytes=0-{nbytes - 1}")
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return b""  # InvalidRange: the object exists and is empty
        body = out["Body"]
        try:
            data: bytes = await body.read()
        finally:
            body.close()
        return data

    async def remove(self, keys: list[str]) -> None:
        for start in range(0, len(keys), _DELETE_BATCH):
            objects = [{"Key": self._key(k)} for k in keys[start : start + _DELETE_BATCH]]
            out = await self._call("delete_objects", Delete={"Objects": objects, "Quiet": True})
            errors = out.get("Errors") or []
            if errors:
                first = errors[0]
                raise OSError(errno.EIO, f"{len(errors)} deletes failed, first: {first}")

    async def list_page(self, prefix: str, token: Any) -> tuple[list[ObjectInfo], Any]:
        base = self._key("")
        # The delimiter keeps objects of deeper prefixes (other stores) out of this store.
        params: dict[str, Any] = {"Prefix": base + prefix, "Delimiter": "/"}
        if token is not None:
            params["ContinuationToken"] = token
        page = await self._call("list_objects_v2", **params)
        out = []
        for item in page.get("Contents", []):
            key = item["Key"][len(base) :]
            if key and key[:1] != ".":
                out.append(ObjectInfo(key, int(item["Size"]), _mtime(item)))
        return out, page.get("NextContinuationToken") if page.get("IsTruncated") else None

    async def close(self) -> None:
        creator = getattr(self.fs, "_s3creator", None)
        if getattr(self.fs, "_s3", None) is None or creator is None:
            return
        self.fs._s3 = None
        if hasattr(creator, "clear"):  # S3BucketRegionCache: one client per region
            await creator.clear()
        else:
            await creator.__aexit__(None, None, None)
