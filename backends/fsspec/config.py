"""The fsspec backend's options: what a ``s3://``, ``gs://`` or ``fsspec+proto://`` URL sets.

The protocol sets are here too, since the options are checked against them and the
filesystem calls (:mod:`.ops`) branch on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from hicache.errors import ConfigError

__all__ = ["OBJECT_STORES", "S3_PROTOCOLS", "FsspecConfig"]

S3_PROTOCOLS = frozenset({"s3", "s3a"})
# Single writes are atomic and there are buckets; everything else gets temp-and-move writes.
OBJECT_STORES = S3_PROTOCOLS | {"gs", "gcs", "az", "abfs", "abfss", "adl"}
_SECRET_FIELDS = frozenset({"key", "secret", "token"})


@dataclass(frozen=True, slots=True, repr=False)
class FsspecConfig:
    """Options of ``s3://bucket/prefix?endpoint_url=...&key=...&secret=...&max_concurrency=64``.

    ``key``, ``secret`` and ``region`` are S3 options (``endpoint_url``, ``token`` and ``anon``
    go to any filesystem); other options go in ``storage_options``, a JSON object merged over
    the typed fields (for S3, its ``client_kwargs`` and ``config_kwargs`` merge key by key).
    """

    protocol: str  # the fsspec protocol: the URL's scheme
    root: str  # bucket/prefix for object stores, a path otherwise
    endpoint_url: str | None = None  # an S3-compatible service (MinIO, Ceph, moto)
    key: str | None = None
    secret: str | None = None
    token: str | None = None  # a session token with temporary credentials
    region: str | None = None
    anon: bool = False  # unsigned requests, for public buckets
    storage_options: str = ""  # JSON object of extra filesystem options
    max_concurrency: int = 32  # requests in flight per backend
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    retries: int = 2  # retries of a failed request (connection errors, throttling, 5xx)
    create_bucket: bool = False  # create a missing bucket at open instead of failing

    def __post_init__(self) -> None:
        protocol = str(self.protocol).lower()
        object.__setattr__(self, "protocol", protocol)
        if not protocol.isidentifier():
            raise ConfigError(f"FsspecConfig.protocol {protocol!r} is not an fsspec protocol")
        root = str(self.root).rstrip("/")
        if protocol in OBJECT_STORES:
            if not root or root.startswith("/"):
                raise ConfigError(f"a {protocol}:// URL needs a bucket: {protocol}://bucket/prefix")
        elif not root:
            raise ConfigError(f"an fsspec+{protocol}:// URL needs a path after the scheme")
        object.__setattr__(self, "root", root)
        if protocol not in S3_PROTOCOLS and (self.key or self.secret or self.region):
            raise ConfigError(
                f"key, secret and region are S3 options; give {protocol}:// credentials in "
                "storage_options (a JSON object of that filesystem's options)"
            )
        if self.max_concurrency <= 0:
            raise ConfigError("FsspecConfig.max_concurrency must be positive")
        if self.retries < 0:
            raise ConfigError("FsspecConfig.retries must be zero or more")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("FsspecConfig timeouts must be positive seconds")
        self.extra_options()  # refuse bad JSON now, not at open

    def extra_options(self) -> dict[str, Any]:
        """``storage_options`` as a dict."""
        if not self.storage_options:
            return {}
        try:
            options = json.loads(self.storage_options)
        except ValueError:
            options = None
        if not isinstance(options, dict):  # the text is not echoed: it may hold credentials
            raise ConfigError('FsspecConfig.storage_options must be a JSON object ({"name": ...})')
        return options

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRET_FIELDS and value is not None:
                text = "'***'"
            elif f.name == "storage_options" and value:  # names shown, values may be secrets
                text = "{" + ", ".join(f"{k!r}: ***" for k in self.extra_options()) + "}"
            else:
                text = repr(value)
            shown.append(f"{f.name}={text}")
        return f"FsspecConfig({', '.join(shown)})"
