"""A real third-party plugin: installed with pip from examples/plugin, found through its entry
points, then held to the conformance suite (both of its backends, and its own test module).

Everything here needs the pip install, so the whole module is marked slow.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from hicache.backends.base import StorageBackend
from hicache.backends.registry import BackendRegistry
from hicache.backends.testing import BackendConformanceTests
from hicache.errors import ConfigError

pytestmark = pytest.mark.slow

PLUGIN_SOURCE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "plugin"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """Install the plugin with pip into a directory put on sys.path for this module only."""
    target = tmp_path_factory.mktemp("plugin-site")
    build = tmp_path_factory.mktemp("plugin-build")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            # Build from a copy: setuptools leaves build/ and *.egg-info next to the sources.
            str(_copy_source(build)),
        ],
        check=True,
        env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.split(".")[0] == "hicache_example_plugin"]:
        sys.modules.pop(name)


def _copy_source(build: pathlib.Path) -> pathlib.Path:
    dest = build / "plugin"
    ignored = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(PLUGIN_SOURCE, dest, ignore=ignored)
    return dest


def test_entry_points_are_listed_with_their_distribution(plugin_site: pathlib.Path) -> None:
    entries = {e.name: e for e in BackendRegistry().entries()}
    origin = "entry point (hicache-example-plugin 0.1.0)"
    assert entries["example"].origin == entries["example-sdk"].origin == origin
    assert entries["example"].target_path == "hicache_example_plugin:ExampleBackend"
    assert entries["example-sdk"].target_path == "hicache_example_plugin:ExampleSdkBackend"
    assert entries["memory"].origin == "built-in"


async def test_open_by_name_and_by_url(plugin_site: pathlib.Path) -> None:
    registry = BackendRegistry()
    cls = registry.load("example")
    assert cls.__module__.startswith("hicache_example_plugin.")
    backend = await registry.open("example://tenant-a")
    try:
        assert isinstance(backend, cls)
        assert backend.config.label == "tenant-a"  # type: ignore[attr-defined]
        assert await backend.put(["p1"], [b"payload"]) == [True]
        assert await backend.get(["p1"]) == [b"payload"]
    finally:
        await backend.close()
    with pytest.raises(ConfigError, match="take no path"):  # it claims the host only
        await registry.open("example://tenant-a/sub")


async def test_blocking_sdk_backend_by_url(plugin_site: pathlib.Path) -> None:
    registry = BackendRegistry()
    cls, _ = registry.resolve_url("example-sdk://ep-url")
    assert cls.__name__ == "ExampleSdkBackend"
    backend = await registry.open("example-sdk://ep-url?latency_s=0.001")
    other = await registry.open("example-sdk://ep-url")  # another client of the same server
    try:
        assert backend.config.latency_s == 0.001  # type: ignore[attr-defined]
        assert await backend.put(["k"], [[b"two ", b"parts"]]) == [True]
        assert await other.get(["k"]) == [b"two parts"]
    finally:
        await backend.close()
        await other.close()
        importlib.import_module("hicache_example_plugin").BlockingKVClient.drop_endpoint("ep-url")


def test_cli_lists_the_plugin(plugin_site: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-m", "hicache.tools.cli", "backends", "--json"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    for name in ("example", "example-sdk"):
        assert rows[name]["available"] is True
        assert rows[name]["schemes"] == [name]
        assert rows[name]["origin"].startswith("entry point (hicache-example-plugin")


def test_the_examples_own_conformance_tests_pass(
    plugin_site: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # What a plugin author runs: pytest on the example's tests, with the example's config.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"],
        cwd=_copy_source(tmp_path),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


# ----- the conformance suite, on backends found by entry-point name -----------------------------
@pytest.mark.usefixtures("plugin_site")
class TestExamplePluginConformance(BackendConformanceTests):
    """What a plugin author gets: the whole contract checked by subclassing one class."""

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await BackendRegistry().open("example://conformance")


def _endpoint(location: pathlib.Path) -> str:
    return "plugin-test-" + hashlib.sha1(str(location).encode()).hexdigest()[:16]


def _client(backend: StorageBackend) -> Any:
    sdk = importlib.import_module("hicache_example_plugin.sdk")
    return sdk.BlockingKVClient(backend.config.endpoint)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("plugin_site")
class TestExampleSdkPluginConformance(BackendConformanceTests):
    """The backend over a blocking SDK, with raw hooks through a client of that SDK."""

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await BackendRegistry().open(f"example-sdk://{_endpoint(location)}")

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        sdk = importlib.import_module("hicache_example_plugin.sdk")
        sdk.BlockingKVClient.drop_endpoint(_endpoint(location))

    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        data: bytes | None = _client(backend).get(key)
        return data

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        _client(backend).put(key, data)
