"""Access rules without a server: key files, key lookup, priority caps, cache namespaces, the
serve flags."""

from __future__ import annotations

import pathlib
import re

import pytest

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.server.auth import (
    DEFAULT_TENANT,
    Access,
    KeyRing,
    cache_namespace,
    key_id,
    parse_key_file,
    priority_cap,
)
from hicache.server.request_body import MAX_PRIORITY
from hicache.tools.cli import build_parser
from hicache.tools.serve.access import access_of

SECRET = "sk-secret-000001"


def test_a_key_file_maps_keys_to_tenants() -> None:
    text = f"# keys\n{SECRET} alice\n\nsk-other-0000002 bob  # a comment\n"
    parsed = parse_key_file(text, "keys")
    assert parsed.keys == {SECRET: "alice", "sk-other-0000002": "bob"}
    assert parsed.priority_caps == {}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"{SECRET}\n", r"keys:1: want 'KEY TENANT \[max_priority=N\]'"),
        (f"{SECRET} alice max_priority=1 extra\n", "4 fields"),
        (f"{SECRET} alice extra\n", "the third field is 'max_priority=N'"),
        (f"{SECRET} alice max_priority=-1\n", "the third field"),
        (f"{SECRET} alice max_priority=+5\n", "the third field"),
        (f"{SECRET} alice priority=5\n", "the third field"),
        (f"{SECRET} alice max_priority={MAX_PRIORITY + 1}\n", "takes 0 to"),
        (f"{SECRET} alice max_priority={'9' * 5000}\n", "takes 0 to"),
        (
            f"{SECRET} alice max_priority=3\nsk-other-0000002 alice max_priority=4\n",
            "keys:2: another line gives the tenant 'alice' max_priority=3",
        ),
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


def test_a_worker_off_loopback_needs_only_its_routers_token(tmp_path: pathlib.Path) -> None:
    """A remote worker (``--worker https://...`` on the router) listens on a public address
    with the router's token as its one key: no --insecure-no-auth needed, and no key of a
    tenant opens it."""
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    access = _access("--http", "0.0.0.0:8001", "--internal-token-file", str(token))
    assert access.internal_token == "t" * 32 and not access.keys.configured  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match="no API key"):  # a router still needs keys
        _access("--http", "0.0.0.0:8001", "--internal-token-file", str(token),
                "--worker", "https://10.0.0.2:8001")  # fmt: skip


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


# ----- priority caps ------------------------------------------------------------------------------
def test_a_key_file_column_caps_its_tenants_priority() -> None:
    text = f"{SECRET} alice max_priority=7\nsk-alice-0000002 alice\nsk-bob-00000003 bob\n"
    parsed = parse_key_file(text, "keys")
    assert parsed.keys["sk-alice-0000002"] == "alice"
    assert parsed.priority_caps == {"alice": 7}  # the tenant's, not the line's


def test_the_priority_cap_is_the_tenants_else_the_servers() -> None:
    keys = KeyRing({SECRET: DEFAULT_TENANT})
    assert priority_cap(Access(keys), DEFAULT_TENANT) == 0  # the default: no raising
    assert priority_cap(Access(), None) == 0
    assert priority_cap(Access(keys, max_priority=9), DEFAULT_TENANT) == 9
    assert priority_cap(Access(keys, max_priority=9), None) == 9
    # A worker behind a router: the router capped the request already.
    assert priority_cap(Access(internal_token="t" * 16), "alice") == MAX_PRIORITY
    with pytest.raises(ConfigError, match="max_priority"):
        Access(max_priority=-1)


def test_key_file_caps_override_the_server_and_survive_a_reload(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{SECRET} alice max_priority=5\nsk-bobkey-000002 bob\n")
    access = Access(KeyRing({}, path), max_priority=2)
    assert priority_cap(access, "alice") == 5 and priority_cap(access, "bob") == 2
    access.keys.reload()  # SIGHUP, the file unchanged
    assert priority_cap(access, "alice") == 5
    path.write_text(f"{SECRET} alice max_priority=1\nsk-bobkey-000002 bob max_priority=0\n")
    access.keys.reload()
    assert priority_cap(access, "alice") == 1 and priority_cap(access, "bob") == 0
    path.write_text(f"{SECRET} alice max_priority=nine\n")
    access.keys.reload()  # does not parse: keys and caps in force stay
    assert priority_cap(access, "alice") == 1 and priority_cap(access, "bob") == 0
    path.write_text(f"{SECRET} alice\n")
    access.keys.reload()  # the column removed: the server's cap again
    assert priority_cap(access, "alice") == 2


def test_serve_flags_set_the_priority_cap(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{SECRET} alice max_priority=8\n")
    assert _access("--http", "127.0.0.1:0").max_priority == 0  # type: ignore[attr-defined]
    access = _access("--http", "127.0.0.1:0", "--api-keys", str(path), "--max-priority", "3")
    assert priority_cap(access, "alice") == 8 and priority_cap(access, None) == 3  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        _access("--http", "127.0.0.1:0", "--max-priority", "-1")


# ----- the admin key, off the command line --------------------------------------------------------
ADMIN = "sk-admin-0000009"


def test_the_admin_key_comes_from_a_file_or_the_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "admin"
    path.write_text(f"  {ADMIN}  \nignored second line\n")
    path.chmod(0o600)
    with caplog.at_level("WARNING"):
        access = _access("--http", "127.0.0.1:0", "--admin-api-key-file", str(path))
    assert access.admin_key == ADMIN and not caplog.records  # type: ignore[attr-defined]
    path.chmod(0o640)
    with caplog.at_level("WARNING"):
        _access("--http", "127.0.0.1:0", "--admin-api-key-file", str(path))
    assert "readable by other users (mode 640)" in caplog.text and ADMIN not in caplog.text
    monkeypatch.setenv("HICACHE_ADMIN_API_KEY", ADMIN)
    assert _access("--http", "127.0.0.1:0").admin_key == ADMIN  # type: ignore[attr-defined]
    monkeypatch.setenv("HICACHE_ADMIN_API_KEY", "")  # set but empty: no admin key
    assert _access("--http", "127.0.0.1:0").admin_key is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("flags", "env", "words"),
    [
        (["--admin-api-key", ADMIN, "--admin-api-key-file", "FILE"], None,
         "given 2 ways (--admin-api-key, --admin-api-key-file)"),
        (["--admin-api-key-file", "FILE"], ADMIN, "--admin-api-key-file, $HICACHE_ADMIN_API_KEY"),
        (["--admin-api-key", ADMIN], ADMIN, "given 2 ways"),
        (["--admin-api-key", ADMIN, "--admin-api-key-file", "FILE"], ADMIN, "given 3 ways"),
        (["--admin-api-key-file", "SHORT"], None, "at least 8"),
        (["--admin-api-key-file", "EMPTY"], None, "at least 8"),
        (["--api-key", ADMIN, "--admin-api-key-file", "FILE"], None, "must differ"),
        (["--admin-api-key-file", "FILE", "--workers", "2"], None, "single server's"),
    ],
)  # fmt: skip
def test_bad_admin_key_sources_are_refused(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    env: str | None,
    words: str,
) -> None:
    files = {"FILE": f"{ADMIN}\n", "SHORT": "short\n", "EMPTY": "\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path / f) if f in files else f for f in flags]
    if env is not None:
        monkeypatch.setenv("HICACHE_ADMIN_API_KEY", env)
    with pytest.raises(InvalidArgumentError, match=re.escape(words)) as caught:
        _access("--http", "127.0.0.1:0", *argv)
    assert ADMIN not in str(caught.value)
