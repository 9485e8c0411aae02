"""Fixtures shared across test packages: services started here on 127.0.0.1 and stopped by pid."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from hicache.tools.services.moto import MotoServer, moto_server


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server for the session; tests make their own buckets."""
    if importlib.util.find_spec("moto") is None:
        pytest.skip("moto[server] is not installed")
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with moto_server(str(log)) as server:
        yield server
