"""Backend URLs shown to people: credentials redacted; attach URLs checked against prefixes."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from hicache.urls import allowed_by, redact_url, scrub

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
        ("mooncake://kv-master:50051/x", True),
        ("mooncake://kv-master.evil:50051", True),  # a prefix is a prefix: end it with ':'
        ("mooncake://kv-master:50051?metadata_server=http://10.0.0.9:1", False),  # options
        ("mooncake://other:50051", False),
    ],
)
def test_remote_urls_match_host_and_path_and_no_added_options(url: str, ok: bool) -> None:
    assert (allowed_by(url, ["mooncake://kv-master"]) is not None) is ok


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
