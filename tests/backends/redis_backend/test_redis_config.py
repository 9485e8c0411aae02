"""``redis://`` URLs: what each part and option sets, the typed error naming a bad one, where the
password comes from, and that it never shows (repr, errors, logs, redacted URLs)."""

from __future__ import annotations

import logging
import pathlib

import pytest
from cli_kit import run
from redis_kit import DEFAULT_PASSWORD, needs_redis

from hicache.backends.redis import RedisBackend, RedisConfig
from hicache.backends.redis.config import PASSWORD_ENV
from hicache.backends.registry import default_registry, open_backend
from hicache.errors import BackendUnavailableError, ConfigError
from hicache.tools.services.process import free_port
from hicache.tools.services.redis import RedisServer
from hicache.urls import redact_url, scrub

SECRET = "s3cr3t-Pa55"


def config_of(url: str) -> RedisConfig:
    cls, inner = default_registry.resolve_url(url)
    assert cls is RedisBackend
    config = cls.config_from_url(inner, {})
    assert isinstance(config, RedisConfig)
    return config


def test_every_scheme_opens_the_redis_backend() -> None:
    for scheme in ("redis", "rediss", "valkey", "valkeys", "REDIS"):
        assert default_registry.resolve_url(f"{scheme}://h")[0] is RedisBackend
    assert config_of("rediss://h").tls and config_of("valkeys://h").tls
    assert not config_of("redis://h").tls and not config_of("valkey://h").tls


def test_the_location_sets_host_port_db_and_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    c = config_of("redis://alice:p%40ss@cache.example:6380/3?key_prefix=kv:&ttl=60")
    assert (c.host, c.port, c.db, c.username, c.password) == (
        "cache.example",
        6380,
        3,
        "alice",
        "p@ss",
    )
    assert (c.key_prefix, c.ttl) == ("kv:", 60)
    c = config_of("redis://:pw@[::1]")
    assert (c.address, c.username, c.password) == (("::1", 6379), None, "pw")
    c = config_of("redis://")
    assert c.address == ("127.0.0.1", 6379) and c.password is None and c.key_prefix == "hicache:"
    c = config_of("redis:///2?sentinel=a:1,b&service=mymaster")
    assert c.sentinels() == [("a", 1), ("b", 26379)] and c.db == 2 and not c.host
    c = config_of("redis://n1:7000?cluster=true&max_connections=8&timeout=0.5")
    assert c.cluster and c.max_connections == 8 and c.timeout == 0.5


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis://h?bogus=1", "bogus"),
        ("redis://h?ttl=-1", "ttl"),
        ("redis://h?ttl=soon", "ttl"),
        ("redis://h?cluster=maybe", "cluster"),
        ("redis://h?max_connections=0", "max_connections"),
        ("redis://h?timeout=0", "timeout"),
        ("redis://h?key_prefix=a*b", "key_prefix"),
        ("redis://h?ca_file=/ca.pem", "ca_file"),
        ("rediss://h?cert_file=/c.pem", "cert_file and key_file"),
        ("redis://h?tls=true", "tls"),
        ("redis://h/x", "database number"),
        ("redis://h:99999", "port"),
        ("redis://h/1?cluster=true", "db"),
        ("redis://h?sentinel=a:1&service=m", "sentinel"),
        ("redis://?sentinel=a:1", "service"),
        ("redis://?service=m", "service"),
        ("redis://?sentinel=a:x&service=m", "sentinel"),
        ("redis://?sentinel=a:1&service=m&cluster=true", "sentinel and cluster"),
        ("redis://h?password=a&password_file=/p", "password or password_file"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(url: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        config_of(url)


def test_the_password_comes_from_the_url_a_file_or_the_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert config_of("redis://h").password == "from-env"
    assert config_of("redis://u:from-url@h").password == "from-url"
    secret_file = tmp_path / "pw"
    secret_file.write_text("from-file\n")
    c = config_of(f"redis://h?password_file={secret_file}")
    assert c.password is None and c.read_password() == "from-file"
    with pytest.raises(ConfigError, match="password_file"):
        config_of(f"redis://h?password_file={tmp_path / 'absent'}").read_password()
    # Credentials twice: refused without quoting either.
    with pytest.raises(ConfigError) as refused:
        config_of(f"redis://u:{SECRET}@h?password=other")
    assert SECRET not in str(refused.value) and "other" not in str(refused.value)


def test_redaction_covers_every_way_a_url_carries_the_password() -> None:
    for url in (
        f"redis://alice:{SECRET}@h:6379/0",
        f"rediss://:{SECRET}@h?ca_file=/ca.pem",
        f"redis://h?password={SECRET}&key_prefix=kv:",
        f"valkey://h?sentinel=a:1&service=m&password={SECRET}",
    ):
        shown = redact_url(url)
        assert SECRET not in shown and "***" in shown, shown
        assert SECRET not in scrub(f"failed to open {url}; password {SECRET}", url)
    assert "/run/pw" in redact_url("redis://h?password_file=/run/pw"), "a path is no secret"
    assert "alice" not in redact_url(f"redis://alice:{SECRET}@h")


def test_the_config_repr_hides_the_password() -> None:
    config = config_of(f"redis://alice:{SECRET}@h")
    assert SECRET not in repr(config) and SECRET not in str(config) and "'***'" in repr(config)


@needs_redis
@pytest.mark.asyncio
async def test_the_password_never_shows_in_repr_errors_or_logs(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with RedisServer(str(tmp_path), password=SECRET) as server:
        with pytest.raises(ConfigError, match="authentication") as wrong:
            await open_backend(server.url(user="", password=SECRET + "-wrong"))
        assert SECRET not in str(wrong.value)
        async with await open_backend(server.url(user="", password=SECRET, timeout="1")) as backend:
            assert await backend.put(["k"], [b"v"]) == [True]
            shown = [repr(backend), str(backend), repr(getattr(backend, "config", None))]
            server.stop()
            assert await backend.get(["k"]) == [None]  # logged as a failure
    with pytest.raises(BackendUnavailableError) as down:
        await open_backend(server.url(user="", password=SECRET, timeout="1"))
    texts = [*shown, str(down.value), caplog.text]
    assert all(SECRET not in text for text in texts)
    assert "failed" in caplog.text


@pytest.mark.asyncio
async def test_nothing_listening_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailableError, match="cannot reach redis"):
        await open_backend(f"redis://127.0.0.1:{free_port()}?timeout=1")


@pytest.mark.asyncio
async def test_the_acl_user_and_the_default_user_authenticate(auth_server: RedisServer) -> None:
    for url in (auth_server.url(user="", password=DEFAULT_PASSWORD), auth_server.url()):
        if "@" not in url:  # no password: refused with a typed error
            with pytest.raises(ConfigError, match="authentication"):
                await open_backend(url)
            continue
        backend = await open_backend(url)
        assert await backend.put(["acl"], [b"v"]) == [True]
        await backend.close()


def test_hicache_backends_lists_redis(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "backends")
    assert code == 0
    (row,) = [line for line in out.splitlines() if line.startswith("redis ")]
    assert "redis://" in row and "valkeys://" in row and "listable" in row
