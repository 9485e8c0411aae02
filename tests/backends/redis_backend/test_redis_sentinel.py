"""``redis://?sentinel=...&service=...``: the master a sentinel names, through a forced failover
to its replica (``SENTINEL FAILOVER``): the calls during it are misses or failed puts, counted,
never raised, and the backend goes on with the new master by itself."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Iterator

import pytest
from redis_kit import SKIP_REASON, open_redis

from hicache.backends.redis import RedisConfig
from hicache.backends.registry import open_backend
from hicache.errors import BackendUnavailableError, ConfigError
from hicache.tools.services.redis import RedisSentinels, redis_sentinels

SENTINEL_PASSWORD = "sentinel-pw-3b9e1d"


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinels]:
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    directory: pathlib.Path = tmp_path_factory.mktemp("sentinel")
    with redis_sentinels(str(directory)) as started:
        yield started


@pytest.mark.asyncio
async def test_pages_survive_a_forced_failover(sentinels: RedisSentinels) -> None:
    async with await open_redis(sentinels.url(key_prefix="sen:", timeout="2")) as backend:
        keys = [f"s-{i}" for i in range(8)]
        assert await backend.put(keys, [b"page"] * 8) == [True] * 8
        # Replicated before the switch, so the new master has them.
        sentinels.master.cli("WAIT", "1", "2000")
        old = sentinels.master_port()
        assert sentinels.sentinel.cli("SENTINEL", "FAILOVER", sentinels.service) == "OK"
        deadline = time.monotonic() + 20
        while sentinels.master_port() == old:
            assert time.monotonic() < deadline, "the sentinel did not switch masters"
            await backend.exists(keys)  # during the switch: misses at worst, never raised
            await asyncio.sleep(0.05)
        # The old master turns replica (READONLY to writes): the backend must follow.
        while time.monotonic() < deadline:
            if await backend.put(["after"], [b"new"]) == [True]:
                break
            await asyncio.sleep(0.1)
        assert await backend.get(["after", *keys]) == [b"new"] + [b"page"] * 8
        assert sentinels.master_port() == sentinels.replica.port


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinels]:
    """Sentinels that ask their clients for a password of their own."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    directory: pathlib.Path = tmp_path_factory.mktemp("sentinel-auth")
    with redis_sentinels(str(directory), sentinel_password=SENTINEL_PASSWORD) as started:
        yield started


@pytest.mark.asyncio
async def test_sentinels_that_ask_for_a_password_get_theirs(
    guarded: RedisSentinels, tmp_path: pathlib.Path
) -> None:
    with pytest.raises(BackendUnavailableError) as refused:
        await open_backend(guarded.url(timeout="2"))
    assert "sentinel_password" in str(refused.value)  # says what to set
    with pytest.raises(BackendUnavailableError) as wrong:
        await open_backend(guarded.url(timeout="2", sentinel_password="not-it"))
    assert "not-it" not in str(wrong.value)
    secret = tmp_path / "sentinel-pw"
    secret.write_text(SENTINEL_PASSWORD + "\n")
    for options in ({"sentinel_password": SENTINEL_PASSWORD}, {"sentinel_password_file": secret}):
        async with await open_backend(
            guarded.url(key_prefix="auth:", timeout="2", **options)
        ) as backend:
            assert SENTINEL_PASSWORD not in repr(backend.config)
            assert await backend.put(["k"], [b"v"]) == [True]
            assert await backend.get(["k"]) == [b"v"]


def test_sentinel_password_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"sentinel=\.\.\. only"):
        RedisConfig(sentinel_password="x")
    with pytest.raises(ConfigError, match="not both"):
        RedisConfig(
            sentinel="127.0.0.1:1", service="s", sentinel_password="x", sentinel_password_file="f"
        )
    config = RedisConfig(sentinel="127.0.0.1:1", service="s", sentinel_password_file="/nonexistent")
    with pytest.raises(ConfigError, match="sentinel_password_file") as missing:
        config.read_sentinel_password()
    assert "/nonexistent" in str(missing.value)
