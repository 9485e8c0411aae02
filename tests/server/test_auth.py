"""Access rules without a server: key files, key lookup, cache namespaces, the serve flags."""

from __future__ import annotations

import pathlib

import pytest

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.server.auth import DEFAULT_TENANT, KeyRing, cache_namespace, key_id, parse_key_file
from hicache.tools.cli import build_parser
from hicache.tools.serve.access import access_of

SECRET = "sk-secret-000001"


def test_a_key_file_maps_keys_to_tenants() -> None:
    text = f"# keys\n{SECRET} alice\n\nsk-other-0000002 bob  # a comment\n"
    assert parse_key_file(text, "keys") == {SECRET: "alice", "sk-other-0000002": "bob"}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"{SECRET}\n", "keys:1: want 'KEY TENANT'"),
        (f"{SECRET} alice extra\n", "3 fields"),
        (f"{SECRET} a\n{SECRET} b\n", "keys:2: this key is listed twice"),
        ("short alice\n", "at least 8"),
        (f"{SECRET} {'t' * 200}\n", "printable"),
    ],
)
def test_a_bad_key_file_names_the_line_never_the_key(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        parse_key_file(text, "keys")
    assert SECRET not in str(caught.value)


def test_every_key_is_looked_up_and_a_reload_keeps_the_old_keys_on_a_bad_file(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{SECRET} alice\n")
    ring = KeyRing({"sk-direct-000003": DEFAULT_TENANT}, path)
    assert ring.tenant_of(SECRET) == "alice" and ring.tenant_of("sk-direct-000003") == "default"
    assert ring.tenant_of(SECRET[:-1]) is None and ring.tenant_of(SECRET + "x") is None
    path.write_text("sk-newkey-000004 carol\n")
    ring.reload()  # SIGHUP
    assert ring.tenant_of(SECRET) is None and ring.tenant_of("sk-newkey-000004") == "carol"
    path.write_text("not a key file\n")
    ring.reload()
    assert ring.tenant_of("sk-newkey-000004") == "carol"  # still the keys in force
    assert len(key_id(SECRET)) == 8 and SECRET not in key_id(SECRET)


def test_namespaces_separate_tenants_and_salts() -> None:
    assert cache_namespace(None, None, share_cache=False) is None  # the shared namespace
    names = {
        cache_namespace(tenant, salt, share_cache=False)
        for tenant in ("alice", "bob", None)
        for salt in (None, "s1", "s2")
    }
    assert len(names) == 9
    assert cache_namespace("alice", None, True) is None  # shared across tenants
    assert cache_namespace("alice", "s1", True) == cache_namespace("bob", "s1", True)
    # Names never appear in a namespace (they reach L3 keys and trees).
    assert "alice" not in str(cache_namespace("alice", "s1", False))


def _access(*argv: str) -> object:
    args = build_parser(["serve"]).parse_args(["serve", *argv])
    return access_of(args)


def test_serve_flags_give_the_access_rules(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{SECRET} alice\n")
    monkeypatch.setenv("HICACHE_API_KEY", "sk-fromenv-00005")
    access = _access("--http", "0.0.0.0:8000", "--api-keys", str(path), "--share-cache")
    assert access.keys.tenant_of(SECRET) == "alice"  # type: ignore[attr-defined]
    assert access.keys.tenant_of("sk-fromenv-00005") == DEFAULT_TENANT  # type: ignore[attr-defined]
    assert access.share_cache and access.admin_key is None  # type: ignore[attr-defined]
    monkeypatch.delenv("HICACHE_API_KEY")
    with pytest.raises(InvalidArgumentError, match="no API key"):
        _access("--http", "10.1.2.3:8000")
    assert not _access("--http", "0.0.0.0:0", "--insecure-no-auth").keys.configured  # type: ignore[attr-defined]
    assert not _access("--http", "[::1]:0").keys.configured  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match="differ"):
        _access("--http", "127.0.0.1:0", "--api-key", SECRET, "--admin-api-key", SECRET)


@pytest.mark.parametrize("emptied", ["", "# every key removed\n", "\n\n"])
def test_a_reload_that_would_leave_no_key_keeps_the_keys_in_force(
    tmp_path: pathlib.Path, emptied: str
) -> None:
    """An emptied key file (or one read half-written by a rotation) must not turn
    authentication off on a server that started with keys."""
    path = tmp_path / "keys"
    path.write_text(f"{SECRET} alice\n")
    ring = KeyRing({}, path)
    path.write_text(emptied)
    ring.reload()  # SIGHUP
    assert ring.configured and ring.tenant_of(SECRET) == "alice"
    path.unlink()
    ring.reload()
    assert ring.configured and ring.tenant_of(SECRET) == "alice"


def test_a_ring_started_without_keys_may_reload_into_keys(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys"
    path.write_text("")
    ring = KeyRing({}, path)
    assert not ring.configured
    path.write_text(f"{SECRET} alice\n")
    ring.reload()
    assert ring.tenant_of(SECRET) == "alice"


def test_a_presented_key_that_is_not_utf8_matches_nothing() -> None:
    ring = KeyRing({SECRET: DEFAULT_TENANT})
    # aiohttp hands a header's undecodable bytes on as surrogates.
    assert ring.tenant_of(SECRET[:-1] + "\udcff") is None
    assert len(key_id(SECRET[:-1] + "\udcff")) == 8  # logged by its id, no UnicodeEncodeError


def test_a_secret_file_others_can_read_is_warned_about(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{SECRET} alice\n")
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="hicache.server.auth"):
        KeyRing({}, path)
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="hicache.server.auth"):
        KeyRing({}, path)
    assert "readable by other users (mode 644)" in caplog.text
    assert SECRET not in caplog.text


def test_flags_are_taken_only_by_their_whole_names() -> None:
    """`--rate-l 5` would pass the router's filter of its own flags and reach the workers."""
    parser = build_parser(["serve"])
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["serve", "--rate-l", "5"])
    assert refused.value.code == 2
    assert parser.parse_args(["serve", "--rate-limit", "5"]).rate_limit == 5.0
