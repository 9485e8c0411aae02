"""The backend registry: lazy loading, URL resolution, refusals and actionable errors."""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys
import types

import pytest

from hicache.backends import registry as registry_module
from hicache.backends.memory import MemoryBackend, MemoryConfig
from hicache.backends.registry import BackendRegistry, open_backend
from hicache.errors import (
    BackendLoadError,
    BackendNotFoundError,
    BackendRegistrationError,
    ConfigError,
    InvalidArgumentError,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_builtins_are_listed_once_and_pyproject_repeats_them() -> None:
    # The registry's table is the list; pyproject.toml's entry points must name the same targets.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["hicache.backends"]
    assert declared == {name: known.target for name, known in registry_module._KNOWN.items()}
    # A built-in's scheme resolves to the built-in: no install hint may repeat it.
    schemes = {s for known in registry_module._KNOWN.values() for s in known.schemes}
    assert schemes.isdisjoint(registry_module._INSTALL_HINTS)


def test_installed_metadata_matches_the_builtins() -> None:
    # A stale install (entry points of moved modules) would be a conflict at run time.
    installed = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="hicache.backends")
        if ep.dist is not None and ep.dist.name == "hicache"
    }
    if not installed:
        pytest.skip("hicache is not installed (a source tree on sys.path)")
    assert installed == {name: known.target for name, known in registry_module._KNOWN.items()}


def test_builtins_are_registered_and_not_imported_until_used() -> None:
    registry = BackendRegistry(group=None)
    names = [e.name for e in registry.entries()]
    assert {"memory", "file", "shm"} <= set(names)
    assert all(isinstance(e.target, str) for e in registry.entries())
    assert registry.load("memory") is MemoryBackend


async def test_open_by_url_with_query_options_and_overrides() -> None:
    backend = await open_backend("memory://?capacity_bytes=4M")
    try:
        assert isinstance(backend, MemoryBackend)
        assert backend.config == MemoryConfig(capacity_bytes=4 << 20)
    finally:
        await backend.close()
    backend = await open_backend("memory://?capacity_bytes=4M", capacity_bytes=1024)
    assert backend.config.capacity_bytes == 1024  # type: ignore[attr-defined]
    await backend.close()


async def test_bad_options_name_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        await open_backend("memory://?capacty=1")
    with pytest.raises(ConfigError, match="capacity_bytes"):
        await open_backend("memory://?capacity_bytes=lots")


def test_unknown_name_and_scheme_list_what_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = BackendRegistry(group=None)
    with pytest.raises(BackendNotFoundError, match=r"memory \(memory://\)"):
        registry.load("nosuch")
    # A scheme a plugin would serve: the error says how to get one.
    monkeypatch.setitem(registry_module._INSTALL_HINTS, "wasb", "pip install 'hicache[wasb]'")
    with pytest.raises(BackendNotFoundError) as info:
        registry.resolve_url("wasb://bucket/prefix")
    assert "hicache[wasb]" in str(info.value) and "file (file://)" in str(info.value)
    # The first-party optional backends are known by scheme, with their install hint listed.
    assert "fsspec (s3://" in str(info.value) and "hicache[mooncake]" in str(info.value)
    with pytest.raises(LookupError):  # the typed error is also a LookupError
        registry.resolve_url("zzz://x")
    with pytest.raises(InvalidArgumentError):
        registry.resolve_url("no-scheme-here")


def test_register_refuses_silent_overwrite() -> None:
    registry = BackendRegistry(group=None)

    class Other(MemoryBackend):
        name = "memory"

    with pytest.raises(BackendRegistrationError, match="replace=True"):
        registry.register("memory", Other)
    assert registry.load("memory") is MemoryBackend
    registry.register("memory", Other, replace=True)
    assert registry.load("memory") is Other
    with pytest.raises(InvalidArgumentError):
        registry.register("x", "no_colon_here")


def test_explicit_backend_prefix_in_url() -> None:
    registry = BackendRegistry(group=None)

    class Mirror(MemoryBackend):
        url_schemes = ()

    registry.register("mirror", Mirror)
    cls, url = registry.resolve_url("mirror+memory://somewhere?x=1")
    assert cls is Mirror and url == "memory://somewhere?x=1"


def test_runtime_registration_declares_schemes_from_the_class() -> None:
    registry = BackendRegistry(group=None)

    class Tape(MemoryBackend):
        name = "tape"
        url_schemes = ("tape", "lto")

    registry.register("tape", Tape)
    assert registry.resolve_url("lto://drive0")[0] is Tape


def test_import_failure_is_a_typed_error_with_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = BackendRegistry(group=None)
    registry.register("broken", "hicache_no_such_module_xyz:Backend")
    with pytest.raises(BackendLoadError, match="could not be imported"):
        registry.load("broken")
    module = types.ModuleType("hicache_fake_plugin_mod")
    module.NotABackend = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hicache_fake_plugin_mod", module)
    registry.register("wrong", "hicache_fake_plugin_mod:NotABackend")
    with pytest.raises(BackendLoadError, match="not a StorageBackend"):
        registry.load("wrong")
    registry.register("missing-attr", "hicache_fake_plugin_mod:Nope")
    with pytest.raises(BackendLoadError, match="no attribute"):
        registry.load("missing-attr")


def test_entry_point_claiming_a_builtin_name_is_a_conflict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class FakeEntryPoint:
        name = "file"
        value = "evil_plugin:FileBackend"
        dist = None

    def fake_entry_points(group: str) -> list[FakeEntryPoint]:
        assert group == "hicache.backends"
        return [FakeEntryPoint()]

    monkeypatch.setattr("importlib.metadata.entry_points", fake_entry_points)
    registry = BackendRegistry()
    with pytest.raises(BackendRegistrationError, match="evil_plugin"):
        registry.load("file")
    assert registry.load("memory") is MemoryBackend
