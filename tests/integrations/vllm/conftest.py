"""Fixtures for the vLLM tier tests. vLLM is imported only inside them (from vllm_kit): the
tests run in the vLLM venv and each module skips itself elsewhere.

``contract_url`` adds a real ``mooncake_master`` (one for the session, each test in a key prefix
of its own) and a real ``redis-server`` (tests/integrations/conftest.py) to the local stores,
for the contract tests vLLM applies to its own ``fs`` tier.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from redis_engine_kit import redis_server, redis_url  # noqa: F401 (fixtures)

if TYPE_CHECKING:
    from vllm_kit import Primary

    from hicache.tools.services.mooncake import MooncakeMaster

_PREFIXES = itertools.count()


@pytest.fixture(scope="session")
def mooncake() -> Iterator[MooncakeMaster]:
    from hicache.backends.mooncake.client import load_store_class
    from hicache.errors import BackendLoadError, BackendUnavailableError
    from hicache.tools.services.mooncake import mooncake_master, mooncake_master_path

    try:
        load_store_class()
        mooncake_master_path()
    except (BackendLoadError, BackendUnavailableError, OSError) as exc:
        pytest.skip(f"Mooncake: {exc}")
    with mooncake_master() as master:
        yield master


@pytest.fixture(params=["disk", "file", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    return f"{request.param}://{tmp_path / 'store'}"


@pytest.fixture(params=["disk", "file", "memory", "mooncake", "redis"])
def contract_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "mooncake":
        master = request.getfixturevalue("mooncake")
        prefix = f"vllm-test-{next(_PREFIXES)}/"  # the master outlives each test's keys
        return (
            f"mooncake://{master.address}?metadata_server={master.metadata_url}&key_prefix={prefix}"
        )
    if request.param == "memory":
        return "memory://"
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))  # tests/integrations/conftest.py
    return f"{request.param}://{tmp_path / 'store'}"


@pytest.fixture
def shared_url(contract_url: str) -> str:
    if contract_url.startswith("memory:"):
        pytest.skip("each memory:// backend is private to its tier")
    return contract_url


@pytest.fixture
def make_tier() -> Iterator[Callable[..., Primary]]:
    """Builds tiers through vLLM's factory; shuts every one down at the end."""
    from vllm_kit import build_tier

    made: list[Any] = []

    def build(url: str, **spec_kw: Any) -> Primary:
        tier, primary = build_tier(url, **spec_kw)
        made.append(tier)
        return tier, primary

    yield build
    for tier in made:
        tier.shutdown()
