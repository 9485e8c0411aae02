"""``hicache serve --http`` as a user runs it: a process that prints where it listens, answers
through a real HTTP client, and drains and exits 0 on SIGTERM. Its L3 namespace carries the
model's fingerprint: a restart of the same model hits the pages it wrote, another seed of the
same shapes does not.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_kit import SMALL, listening, serve_argv

from hicache.models.hf.fingerprint import config_fingerprint

PROMPT = list(range(1, 97))  # 6 pages of 16


@contextmanager
def server(l3: pathlib.Path, *extra: str) -> Iterator[str]:
    """A running ``serve --http`` on a free port; yields its URL; SIGTERM at the end."""
    argv = serve_argv("--http", "127.0.0.1:0", "--l3", f"file://{l3}", *extra)
    with listening(argv, "drained", stop_s=60) as url:
        yield url


def l3_hits(url: str) -> float:
    """Serve PROMPT once; the server's L3 hit tokens so far."""
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                        timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "hicache_request_hit_tokens_total" and sample.labels == {
                "tier": "l3"
            }:
                return sample.value
    raise AssertionError("no hicache_request_hit_tokens_total{tier=l3} in /metrics")


def test_serve_answers_then_drains_on_sigterm(tmp_path: pathlib.Path) -> None:
    with server(tmp_path / "l3") as url:
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["model"] == "hicache-dense"
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3},
                            timeout=60)  # fmt: skip
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 3
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 0}, timeout=10)
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def test_a_restart_hits_its_own_pages_and_not_another_seeds(tmp_path: pathlib.Path) -> None:
    l3 = tmp_path / "l3"
    with server(l3, "--seed", "1") as url:
        assert l3_hits(url) == 0  # a cold store
    with server(l3, "--seed", "1") as url:
        assert l3_hits(url) >= len(PROMPT) - 16  # read back: all but the page with the last token
    with server(l3, "--seed", "2") as url:
        assert l3_hits(url) == 0  # same shapes, other weights: other keys


def test_fingerprints_tell_configs_apart() -> None:
    base = {"preset": "dense", "hidden": 64, "seed": 1}
    assert config_fingerprint(base) == config_fingerprint(dict(reversed(base.items())))
    assert config_fingerprint(base) != config_fingerprint({**base, "seed": 2})


TLS_FLAGS = ["--ssl-certfile", "pyproject.toml", "--ssl-keyfile", "pyproject.toml"]
ADMIN_TWICE = ["--admin-api-key", "k" * 12, "--admin-api-key-file", "pyproject.toml"]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--http", "nonsense"], "HOST:PORT"),
        (["--http", "127.0.0.1:99999"], "HOST:PORT"),
        (["--http", "127.0.0.1:0", "--compare"], "--compare"),
        # A server others can reach answers anyone without a key: refused unless meant.
        (["--http", "0.0.0.0:0"], "no API key is set"),
        (["--http", "127.0.0.1:0", "--api-key", "short"], "at least 8"),
        (["--http", "127.0.0.1:0", "--admin-api-key", "k" * 12, "--workers", "2"], "--workers"),
        # The admin key from one source only; a priority cap is not negative.
        (["--http", "127.0.0.1:0", *ADMIN_TWICE], "given 2 ways"),
        (["--http", "127.0.0.1:0", "--max-priority", "-1"], "--max-priority"),
        (["--http", "127.0.0.1:0", "--ssl-certfile", "pyproject.toml"], "go together"),
        (["--http", "127.0.0.1:0", *TLS_FLAGS], "TLS files"),
    ],
)
def test_bad_http_flags_are_usage_errors(extra: list[str], words: str) -> None:
    argv = [sys.executable, "-m", "hicache.tools.cli", "serve", *SMALL, *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert words in done.stderr


@pytest.mark.slow  # a whole subprocess end to end: out of `-m "not slow"`
def test_policy_flags_serve_the_same_tokens() -> None:
    argv = [sys.executable, "-m", "hicache.tools.cli", "serve", *SMALL, "--clients", "4",
            "--rounds", "2", "--system-tokens", "64", "--turn-tokens", "32", "--eviction", "lfu",
            "--delay-prefill", "--compare", "--json", "--l3", "none"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outputs_identical"] is True
    bad = subprocess.run([*argv, "--eviction", "newest"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--eviction" in bad.stderr
