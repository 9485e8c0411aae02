"""Backend URLs shown to people: credentials redacted; attach URLs checked against --l3-allow
rules (hicache.server.l3_allow)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from hicache.errors import ConfigError, InvalidArgumentError
from hicache.server.l3_allow import (
    L3NotAllowedError,
    admitting_rule,
    allowed_by,
    check_allow_rules,
)
from hicache.urls import redact_url, scrub

SECRETS = ("AKIAEXAMPLE", "s3cr3t-value", "tok-123456", "pw-987654")
URL = (
    "s3://AKIAEXAMPLE:s3cr3t-value@bucket/kv?endpoint_url=http://127.0.0.1:9"
    "&SECRET_ACCESS_KEY=s3cr3t-value&Token=tok-123456&password=pw-987654&region=eu"
)


def test_every_credential_is_redacted_and_the_rest_kept() -> None:
    shown = redact_url(URL)
    assert not any(secret in shown for secret in SECRETS)
    assert shown.startswith("s3://***@bucket/kv?") and "region=eu" in shown
    assert "endpoint_url=http://127.0.0.1:9" in shown  # where it connects is no secret
    assert redact_url("file:///var/cache/kv") == "file:///var/cache/kv"
    # Options named like credentials are masked; others, key_prefix among them, are kept.
    kept = redact_url("mooncake://m:50051?key_prefix=a&api_key=zz&aws_session_token=yy")
    assert "key_prefix=a" in kept and "zz" not in kept and "yy" not in kept


def test_a_message_that_repeats_the_url_or_its_secrets_is_scrubbed() -> None:
    message = f"cannot open {URL}: bad secret s3cr3t-value for key AKIAEXAMPLE"
    cleaned = scrub(message, URL)
    assert not any(secret in cleaned for secret in SECRETS)
    assert "cannot open s3://***@bucket" in cleaned


def test_local_urls_must_resolve_inside_the_prefix(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    (root / "kv").mkdir(parents=True)
    (root / "out").symlink_to(tmp_path)  # a link that leaves the prefix
    rules = [f"file://{root}/"]
    assert allowed_by(f"file://{root}/kv", rules) == rules[0]
    assert allowed_by(f"file://{root}", rules) == rules[0]
    assert allowed_by(f"nixl://{root}/kv", [f"nixl://{root}"]) is not None
    for url in (
        f"file://{root}/../cache/kv",  # no ..
        f"file://{root}/out/elsewhere",  # no link out
        f"file://{root}-sibling/kv",  # a prefix of the name is not a parent
        f"file://otherhost{root}/kv",
        f"nixl://{root}/kv",  # another scheme
        "file:relative/path",
    ):
        assert allowed_by(url, rules) is None, url


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("mooncake://kv-master:50051", True),
        ("mooncake://kv-master:50051/x", False),  # mooncake takes no path: its config refuses
        ("mooncake://kv-master.evil:50051", False),  # the host is the rule's, not a prefix
        ("mooncake://kv-master:500510", False),
        ("mooncake://kv-master", False),  # the rule names a port: the URL gives the same
        ("mooncake://u:p@kv-master:50051", False),  # mooncake reads user-info as host
        ("mooncake://kv-master:50051?metadata_server=http://10.0.0.9:1", False),  # options
        ("mooncake://other:50051", False),
    ],
)
def test_remote_urls_match_host_and_path_and_no_added_options(url: str, ok: bool) -> None:
    assert (allowed_by(url, ["mooncake://kv-master:50051"]) is not None) is ok


def test_a_host_is_matched_whole_with_its_port() -> None:
    assert allowed_by("mooncake://10.0.0.50:50051", ["mooncake://10.0.0.5"]) is None
    assert allowed_by("mooncake://10.0.0.5:50051", ["mooncake://10.0.0.5"]) is None
    assert allowed_by("mooncake://10.0.0.5", ["mooncake://10.0.0.5"]) is not None


def test_a_bucket_and_a_prefix_are_matched_by_whole_segments() -> None:
    rules = ["s3://kvcache", "gs://kv/team/a/"]
    assert allowed_by("s3://kvcache", rules) == rules[0]
    assert allowed_by("s3://kvcache/x/y", rules) == rules[0]
    assert allowed_by("gs://kv/team/a/b", rules) == rules[1]
    for url in (
        "s3://kvcache-other/x",
        "s3://kv%63ache/x",  # the host as written: encoded is another one
        "gs://kv/team/ab",
        "s3://kvcache/%2e%2e/kvcache-other",
        "s3://kvcache/%2E%2e/kvcache-other",
        "gs://kv/team",
        "s3://KEY:SECRET@kvcache/x",  # fsspec refuses user-info, and it is part of the host
    ):
        assert allowed_by(url, rules) is None, url


def test_query_options_must_be_named_by_the_rule(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    for url in (
        f"nixl://{root}/x?plugin=obj&bucket=b&endpoint_url=http://elsewhere:9000",
        f"nixl://{root}/x?plugin=obj&bucket=b",
        f"file://{root}/x?io_threads=1000000",
        f"file://{root}/x?read_only=true",
        f"disk://{root}/x?read_only=true",
        f"disk://{root}/x?io_threads=64",
        f"file://{root}/x?nosuch=1",  # the backend's config refuses it
    ):
        scheme = url.split("://")[0]
        assert allowed_by(url, [f"{scheme}://{root}"]) is None, url
    # fsync chooses nothing but durability: always admitted.
    assert allowed_by(f"file://{root}/x?fsync=true", [f"file://{root}"]) is not None


def test_a_rule_fixes_an_option_or_admits_any_value_with_a_star(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    pinned = [f"disk://{root}?read_only=true"]
    assert allowed_by(f"disk://{root}/kv?read_only=true", pinned) == pinned[0]
    for url in (f"disk://{root}/kv?read_only=false", f"disk://{root}/kv"):
        assert allowed_by(url, pinned) is None, url  # a fixed option is required, as fixed
    star = [f"file://{root}?io_threads=*"]
    assert allowed_by(f"file://{root}/kv?io_threads=8", star) == star[0]
    assert allowed_by(f"file://{root}/kv", star) == star[0]
    assert allowed_by(f"file://{root}/kv?io_threads=8&io_threads=9", star) is None  # twice
    with pytest.raises(ConfigError):  # admitted, and the backend would refuse it: a 400
        admitting_rule(f"file://{root}/kv?io_threads=many", star)
    s3 = ["s3://kvcache?endpoint_url=http://minio:9000&key=*&secret=*"]
    fixed = "s3://kvcache/x?endpoint_url=http://minio:9000&key=K&secret=S"
    assert allowed_by(fixed, s3) == s3[0]
    assert allowed_by("s3://kvcache/x?endpoint_url=http://evil:9000", s3) is None
    assert allowed_by("s3://kvcache/x", s3) is None  # without it: another endpoint (AWS)


def test_scheme_aliases_resolve_as_the_registry_does(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "3fs"
    root.mkdir()
    assert allowed_by(f"3fs://{root}/kv", [f"3fs://{root}"]) is not None
    assert allowed_by(f"hf3fs://{root}/kv", [f"3fs://{root}"]) is not None
    assert allowed_by(f"HF3FS://{root}/kv", [f"hf3fs://{root}"]) is not None
    assert allowed_by(f"3fs://{root}/kv", [f"hf3fs://{root}"]) is not None
    assert allowed_by("fsspec+s3://kvcache/x", ["S3://kvcache"]) is not None
    assert allowed_by(f"file://{root}/kv", [f"3fs://{root}"]) is None
    # fsspec reads the scheme: s3a:// and gs:// are other stores.
    assert allowed_by("s3a://kvcache/x", ["s3://kvcache"]) is None
    assert allowed_by("gs://kvcache/x", ["s3://kvcache"]) is None


@pytest.mark.parametrize(
    "url",
    [
        "3fs://{root}/../../etc",
        "hf3fs://{root}/../../etc",
        "3fs://{root}/kv/%2e%2e/%2E%2e/x",
        "file://{root}/%252e%252e/x",  # decoded twice
        "file://{root}/%2E%2E/x",
        "s3://kvcache/%2e%2e/other",
        "s3://kvcache/x?key_prefix=..%2fother",
        "nixl://..{root}",
        "mooncake://m:1?key_prefix=%2E.",
    ],
)
def test_dot_dot_is_refused_everywhere_however_encoded(url: str, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "3fs"
    (root / "kv").mkdir(parents=True)
    rules = [f"3fs://{root}", f"hf3fs://{root}", f"file://{root}", f"nixl://{root}",
             "s3://kvcache?key_prefix=*", "mooncake://m:1?key_prefix=*"]  # fmt: skip
    assert allowed_by(url.format(root=root), rules) is None
    with pytest.raises(L3NotAllowedError):
        admitting_rule(url.format(root=root), rules)


@pytest.mark.parametrize(
    "rule",
    ["nosuch:///x", "file:///var/../etc", "file:///var/%2e%2e/etc", "file://relative",
     "file:///var/cache?nosuch=*", "disk:///var/cache?io_threads=1&io_threads=2", "no-scheme"],
)  # fmt: skip
def test_a_rule_that_admits_nothing_is_refused_at_start(rule: str) -> None:
    with pytest.raises(InvalidArgumentError, match="--l3-allow"):
        check_allow_rules(["file:///var/cache", rule])
    assert allowed_by("file:///var/cache/kv", [rule]) is None


def test_good_rules_pass_the_start_check() -> None:
    check_allow_rules(["file:///var/cache/", "3fs:///mnt/3fs?io_threads=*", "s3://kvcache/a",
                       "mooncake://[::1]:50051?key_prefix=team-a", "hf3fs:///mnt/x"])  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--l3", URL, "--clients", "1", "--rounds", "1", "--system-tokens", "16",
         "--turn-tokens", "16", "--json", "-q"],
        ["stats", URL],
        ["serve", "--l3", f"file:///nonexistent/x?token={SECRETS[2]}", "--l3-required",
         "--clients", "1", "--rounds", "1", "-q"],
    ],
)  # fmt: skip
def test_the_command_line_never_prints_a_urls_credentials(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hicache.tools.cli", *argv],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    printed = done.stdout + done.stderr
    assert printed.strip(), "the command said nothing"
    assert not any(secret in printed for secret in SECRETS), printed
