"""The raw s3fs baseline of ``hicache bench backends --backend fsspec``, and its S3 server.

The baseline moves the same bytes the plainest way s3fs offers: ``fs.pipe({path: bytes})`` and
``fs.cat([paths])``, one batch of the bench's 32 keys a call, on the bucket
and endpoint the backend was opened with, under a prefix of its own (``<root>/raw-baseline-*``,
left in place: with ``--url``, remove it after the run). Without ``--url``, the
bench runs against a moto server started for the run (``provision``), which is a functional
stand-in for S3, not a performance anchor: both sides share its limits.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hicache.backends.base import StorageBackend
from hicache.tools.services.moto import moto_server

__all__ = ["provision", "raw_baseline"]

_BUCKET = "hicache-bench"


def _raw_fs(config: Any) -> Any:
    import s3fs

    if config.protocol not in ("s3", "s3a"):
        raise ValueError(f"the raw fsspec baseline is for s3:// stores, not {config.protocol}://")
    options: dict[str, Any] = {"anon": config.anon}
    for name in ("key", "secret", "token", "endpoint_url"):
        if getattr(config, name) is not None:
            options[name] = getattr(config, name)
    if config.region:
        options["client_kwargs"] = {"region_name": config.region}
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)


def raw_baseline(
    backend: StorageBackend, scratch: str, work: Any
) -> tuple[Callable[[Any, int, int], None], Callable[[Any, int, int], None]]:
    """(put, get) of one batch over raw s3fs, next to the backend's objects (same bucket and
    endpoint)."""
    config = backend.config  # type: ignore[attr-defined]
    fs = _raw_fs(config)
    base = f"{config.root}/raw-baseline-{uuid.uuid4().hex[:8]}"
    paths = [f"{base}/{key}" for key in work.keys]

    def put(w: Any, lo: int, hi: int) -> None:
        fs.pipe({paths[j]: w.source[j].tobytes() for j in range(lo, hi)})

    def get(w: Any, lo: int, hi: int) -> None:
        got = fs.cat(paths[lo:hi])
        for j in range(lo, hi):
            np.copyto(w.dest[j], np.frombuffer(got[paths[j]], dtype=np.uint8))

    return put, get


@contextlib.contextmanager
def provision(scratch: str, total_bytes: int) -> Iterator[str]:
    """A moto S3 server for the run, with a bucket; yields the backend URL."""
    with moto_server(os.path.join(scratch, "moto.log")) as server:
        import s3fs

        s3fs.S3FileSystem(
            key=server.access_key,
            secret=server.secret_key,
            endpoint_url=server.endpoint_url,
            skip_instance_cache=True,
        ).mkdir(_BUCKET)
        yield (
            f"s3://{_BUCKET}/bench?endpoint_url={server.endpoint_url}"
            f"&key={server.access_key}&secret={server.secret_key}"
        )
