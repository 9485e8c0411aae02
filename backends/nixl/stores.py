"""Where the ``nixl`` backend's objects live: files (POSIX plugin) or S3 objects (OBJ plugin).

A store turns keys into NIXL targets (a registered region plus the device id its transfer
descriptors name) and does what NIXL has no operation for: existence, sizes, delete, listing
and publishing a written object. Every method blocks and runs on a worker thread.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import stat
import threading
from dataclasses import dataclass
from typing import Any

from hicache.backends._open_flags import CLOEXEC, NOFOLLOW
from hicache.backends.base import ObjectInfo
from hicache.backends.file.io import fsync_dir, unlink_quietly
from hicache.backends.nixl.agent import NixlAgent
from hicache.errors import BackendError, BackendUnavailableError
from hicache.keys import validate_key

__all__ = ["ObjStore", "PosixStore", "Target"]

logger = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | CLOEXEC | NOFOLLOW
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC
_TMP_KEY_CHARS = 200  # keeps ".<key>.<pid>.<random>.tmp" under NAME_MAX for 250-char keys


@dataclass(slots=True)
class Target:
    """One object of a transfer: descriptors name it by ``dev`` (a file descriptor or an id)."""

    key: str
    size: int
    dev: int
    meta: str = ""  # the registration's metadata: the S3 object name for OBJ
    tmp: str = ""  # POSIX writes: the temporary file to publish

    @property
    def region(self) -> tuple[int, int, int, str]:
        return (0, self.size, self.dev, self.meta)


def _is_key(name: str) -> bool:
    try:
        validate_key(name)
    except ValueError:
        return False
    return True


class PosixStore:
    """Objects as files ``root/<key>``, written to a hidden temporary file, then renamed.

    One flat directory: ext4 and xfs index large directories, and a flat layout keeps a get
    at one open. A reader holds its open descriptor, so a rename or delete meanwhile never
    tears the object it reads.

    Links: the root is resolved once, at open (it may be reached through the operator's
    links). A key is one path component (keys hold no ``/`` and no ``..``), so the only link
    that could lead outside is an object itself: one that is a symbolic link is no object, and
    is never followed. Reads open with ``O_NOFOLLOW`` (a link is a miss), ``exists`` and
    ``delete`` look at the entry with ``lstat`` (a link is absent and is not unlinked), the
    temporary file is created with ``O_EXCL`` (never through a link) and the publishing rename
    replaces a link, not its target. Refused links are logged, the first one as a warning.
    """

    remote_mem = "FILE"

    def __init__(self, root: str, fsync: bool) -> None:
        self.root = root
        self.fsync = fsync
        self._warned = False

    def prepare(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            self.root = os.path.realpath(self.root)
            probe = f"{self.root}/.probe.{os.getpid()}.{random.getrandbits(48):012x}.tmp"
            os.close(os.open(probe, _WRITE_FLAGS, 0o600))
            os.unlink(probe)
        except OSError as exc:
            raise BackendUnavailableError(
                f"nixl POSIX root {self.root} is unusable ({exc.strerror}): point the URL at a "
                "directory this process can create and write"
            ) from None

    def begin_write(self, key: str, size: int) -> Target:
        tmp = f"{self.root}/.{key[:_TMP_KEY_CHARS]}.{os.getpid()}.{random.getrandbits(48):012x}.tmp"
        return Target(key, size, os.open(tmp, _WRITE_FLAGS, 0o666), tmp=tmp)

    def end_write(self, target: Target, ok: bool) -> bool:
        """Publish a written object atomically (rename), or drop its temporary file."""
        try:
            if ok and self.fsync:
                os.fsync(target.dev)
        except OSError:
            ok = False
        finally:
            os.close(target.dev)
        if ok:
            try:
                os.replace(target.tmp, f"{self.root}/{target.key}")
                if self.fsync:  # the new name must survive a crash with the data
                    fsync_dir(self.root)
                return True
            except OSError:
                pass
        unlink_quietly(target.tmp)
        return False

    def begin_read(self, key: str) -> Target | None:
        try:
            fd = os.open(f"{self.root}/{key}", _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            self._refused(key)
            return None
        try:
            return Target(key, os.fstat(fd).st_size, fd)
        except OSError:
            os.close(fd)
            raise

    def end_read(self, target: Target, ok: bool) -> None:
        os.close(target.dev)

    def exists(self, key: str) -> bool:
        return self._entry(key) is not None

    def exists_many(self, keys: list[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def delete_many(self, keys: list[str]) -> list[bool]:
        """Each key removed in turn: a key named twice was there for its first mention only."""
        return [self.delete(k) for k in keys]

    def delete(self, key: str) -> bool:
        try:
            if self._entry(key) is None:
                return False
            os.unlink(f"{self.root}/{key}")  # a link planted since would go, never its target
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise BackendError(f"cannot delete {self.root}/{key}: {exc.strerror}") from exc

    def _entry(self, key: str) -> os.stat_result | None:
        """``key``'s file as it is (a link not followed); None unless it is a regular file."""
        try:
            st = os.lstat(f"{self.root}/{key}")
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            self._refused(key)
        return st if stat.S_ISREG(st.st_mode) else None

    def _refused(self, key: str) -> None:
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        logger.log(
            level,
            "nixl POSIX store %s: %r is a symbolic link, refused: nothing outside the store is "
            "read or removed (who plants links in it?)",
            self.root,
            key,
        )

    def scan(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        try:
            with os.scandir(self.root) as it:
                for entry in it:
                    name = entry.name
                    if name[0] == "." or not name.startswith(prefix) or not _is_key(name):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted meanwhile
                    if stat.S_ISREG(st.st_mode):
                        out.append(ObjectInfo(name, st.st_size, st.st_mtime))
        except FileNotFoundError:
            pass
        return out

    def close(self) -> None:
        pass


class ObjStore:
    """Objects in one S3 bucket under ``prefix/``, moved by the NIXL OBJ plugin.

    The plugin reads and writes and answers ``query_memory`` (presence only: an empty dict for
    a present object, None for a missing one). It has no size, delete or list operation, so
    those go through botocore against the same endpoint. Sizes are kept in an index: filled by
    this process's puts and by a HEAD the first time an unknown key is read; a read that fails
    drops its entry. Keys name immutable pages, so an entry can only be stale when another
    process deletes or rewrites a key with another size; the first costs a failed transfer and
    a retry, the second would read a truncated or padded object (hicache never does that).
    """

    remote_mem = "OBJ"

    def __init__(self, agent: NixlAgent, client: Any, bucket: str, prefix: str) -> None:
        self.agent = agent
        self.client = client
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def prepare(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # botocore raises ClientError / EndpointConnectionError
            raise BackendUnavailableError(
                f"nixl OBJ bucket {self.bucket!r} is not usable ({_s3_reason(exc)}): create "
                "the bucket and check endpoint_url and the credentials"
            ) from None

    def name(self, key: str) -> str:
        return self.prefix + key

    def begin_write(self, key: str, size: int) -> Target:
        return Target(key, size, self.agent.next_dev_id(), meta=self.name(key))

    def end_write(self, target: Target, ok: bool) -> bool:
        if ok and target.size == 0:  # no transfer moves zero bytes; the object is still due
            try:
                self.client.put_object(Bucket=self.bucket, Key=target.meta, Body=b"")
            except Exception:
                ok = False
        with self._lock:
            if ok:
                self._sizes[target.key] = target.size
            else:
                self._sizes.pop(target.key, None)
        return ok

    def known_size(self, key: str) -> int | None:
        with self._lock:
            return self._sizes.get(key)

    def head(self, key: str) -> int | None:
        """The object's size from S3, recorded in the index; None when absent."""
        try:
            size = int(
                self.client.head_object(Bucket=self.bucket, Key=self.name(key))["ContentLength"]
            )
        except Exception as exc:
            if _s3_status(exc) == 404:
                self.forget(key)
                return None
            raise BackendError(f"S3 HEAD of {key!r} failed ({_s3_reason(exc)})") from None
        with self._lock:
            self._sizes[key] = size
        return size

    def begin_read(self, key: str) -> Target | None:
        size = self.known_size(key)
        if size is None:
            return None
        return Target(key, size, self.agent.next_dev_id(), meta=self.name(key))

    def end_read(self, target: Target, ok: bool) -> None:
        if not ok:
            self.forget(target.key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._sizes.pop(key, None)

    def exists_many(self, keys: list[str]) -> list[bool]:
        found = self.agent.query([(0, 0, 0, self.name(k)) for k in keys], "OBJ")
        return [info is not None for info in found]

    def delete_many(self, keys: list[str]) -> list[bool]:
        present = self.exists_many(keys)
        names = sorted({self.name(k) for k, p in zip(keys, present, strict=True) if p})
        for start in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": n} for n in names[start : start + 1000]]
            try:
                reply = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})
            except Exception as exc:
                raise BackendError(f"S3 delete failed ({_s3_reason(exc)})") from None
            if reply.get("Errors"):
                raise BackendError(f"S3 delete failed for {len(reply['Errors'])} objects")
        for key in keys:
            self.forget(key)
        # A key named twice was there for both: the contract reports presence, per key.
        return present

    def scan(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        try:
            for page in pages:
                for item in page.get("Contents", ()):
                    key = item["Key"][len(self.prefix) :]
                    if _is_key(key):
                        out.append(
                            ObjectInfo(key, int(item["Size"]), item["LastModified"].timestamp())
                        )
        except Exception as exc:
            raise BackendError(f"S3 listing failed ({_s3_reason(exc)})") from None
        return out

    def close(self) -> None:
        with self._lock:
            self._sizes.clear()
        self.client.close()


def _s3_status(exc: Exception) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status is not None else None
    return None


def _s3_reason(exc: Exception) -> str:
    # The class name and status only: botocore messages may echo request details.
    status = _s3_status(exc)
    return f"{type(exc).__name__}" + (f", HTTP {status}" if status is not None else "")
