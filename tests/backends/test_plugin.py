"""A real third-party plugin: installed from tests/plugin_pkg, found through its entry point."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

from hicache.backends.base import StorageBackend
from hicache.backends.registry import BackendRegistry
from hicache.backends.testing import BackendConformanceTests

PLUGIN_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "plugin_pkg"


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
    sys.modules.pop("hicache_example_plugin", None)


def _copy_source(build: pathlib.Path) -> pathlib.Path:
    import shutil

    dest = build / "plugin_pkg"
    shutil.copytree(PLUGIN_SOURCE, dest, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    return dest


def test_entry_point_is_listed_with_its_distribution(plugin_site: pathlib.Path) -> None:
    entries = {e.name: e for e in BackendRegistry().entries()}
    assert "example" in entries
    assert entries["example"].origin == "entry point (hicache-example-plugin 0.1.0)"
    assert entries["example"].target_path == "hicache_example_plugin:ExampleBackend"
    assert entries["memory"].origin == "built-in"


async def test_open_by_name_and_by_url(plugin_site: pathlib.Path) -> None:
    registry = BackendRegistry()
    cls = registry.load("example")
    assert cls.__module__ == "hicache_example_plugin"
    backend = await registry.open("example://tenant-a")
    try:
        assert isinstance(backend, cls)
        assert backend.config.label == "tenant-a"  # type: ignore[attr-defined]
        assert await backend.put(["p1"], [b"payload"]) == [True]
        assert await backend.get(["p1"]) == [b"payload"]
    finally:
        await backend.close()


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
    assert rows["example"]["available"] is True
    assert rows["example"]["schemes"] == ["example"]
    assert rows["example"]["origin"].startswith("entry point (hicache-example-plugin")


@pytest.mark.usefixtures("plugin_site")
class TestExamplePluginConformance(BackendConformanceTests):
    """What a plugin author gets: the whole contract checked by subclassing one class."""

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        return await BackendRegistry().open("example://conformance")
