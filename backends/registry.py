"""Which backends exist, and how a name or URL becomes an open backend.

Backends come from three places: the built-in table below (so a source checkout works without
installed metadata), the ``hicache.backends`` entry-point group (the built-ins declare themselves
there too, and so do third-party plugins), and :func:`register_backend` at run time. Nothing is
imported until a backend is used: an entry is a ``"module:Class"`` string until then.

The built-ins are listed once, in ``_KNOWN``: pyproject.toml repeats them as entry points only
so that tools reading installed metadata see them, and tests/backends/test_registry.py checks
that the two agree (an entry point that named another class would be a conflict at run time).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hicache.backends.base import StorageBackend
from hicache.errors import (
    BackendLoadError,
    BackendNotFoundError,
    BackendRegistrationError,
    InvalidArgumentError,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendEntry",
    "BackendRegistry",
    "default_registry",
    "get_backend_class",
    "list_backends",
    "open_backend",
    "register_backend",
]

ENTRY_POINT_GROUP = "hicache.backends"


@dataclass(frozen=True, slots=True)
class _Known:
    target: str
    schemes: tuple[str, ...]
    install_hint: str


# The built-in backends: the one list of them. It, not pyproject.toml's entry points, is the
# source: it works in a source tree with no installed metadata and carries what an entry point
# cannot (URL schemes, install hints). The entry points must name the same targets (tested).
_KNOWN: dict[str, _Known] = {
    "memory": _Known("hicache.backends.memory:MemoryBackend", ("memory",), ""),
    "file": _Known("hicache.backends.file:FileBackend", ("file",), ""),
    "disk": _Known("hicache.backends.disk:DiskBackend", ("disk",), ""),
    "shm": _Known("hicache.backends.shm:SharedMemoryBackend", ("shm",), ""),
    # First-party backends whose client libraries are optional extras.
    "fsspec": _Known(
        "hicache.backends.fsspec:FsspecBackend",
        ("s3", "s3a", "gs", "gcs", "az", "abfs"),
        "pip install 'hicache[s3]' (s3fs; gcsfs or adlfs for gs:// and az://)",
    ),
    "mooncake": _Known(
        "hicache.backends.mooncake:MooncakeBackend",
        ("mooncake",),
        "pip install 'hicache[mooncake]' (and apt-get install libibverbs1)",
    ),
    "nixl": _Known("hicache.backends.nixl:NixlBackend", ("nixl",), "pip install 'hicache[nixl]'"),
    "3fs": _Known("hicache.backends.hf3fs:Hf3fsBackend", ("hf3fs", "3fs"), ""),
    "redis": _Known(
        "hicache.backends.redis:RedisBackend",
        ("redis", "rediss", "valkey", "valkeys"),
        "pip install 'hicache[redis]'",
    ),
}

# Schemes that no built-in serves but a known plugin would, and how to get it; used only to make
# an unknown-scheme error actionable. A built-in's scheme never reaches this table (it resolves
# to the built-in, whose own install hint then applies), so none is repeated here.
_INSTALL_HINTS: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One registered backend, before or after import."""

    name: str
    target: str | type[StorageBackend]
    origin: str  # "built-in", "entry point (dist 1.0)", "registered at run time"
    schemes: tuple[str, ...] = ()
    install_hint: str = ""

    @property
    def target_path(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"


class BackendRegistry:
    """Names and URL schemes to backend classes, loaded on first use."""

    def __init__(self, group: str | None = ENTRY_POINT_GROUP) -> None:
        self._group = group
        self._entries: dict[str, BackendEntry] = {}
        self._loaded: dict[str, type[StorageBackend]] = {}
        self._conflicts: dict[str, str] = {}
        self._entry_points_read = False
        for name, known in _KNOWN.items():
            self._entries[name] = BackendEntry(
                name, known.target, "built-in", known.schemes, known.install_hint
            )

    def register(
        self,
        name: str,
        target: str | type[StorageBackend],
        *,
        schemes: tuple[str, ...] = (),
        replace: bool = False,
    ) -> None:
        """Register ``target`` (a class or ``"module:Class"``) as ``name``.

        Raises :class:`BackendRegistrationError` when ``name`` is taken, unless ``replace``.
        """
        self._read_entry_points()
        if not name or not isinstance(name, str):
            raise InvalidArgumentError("a backend name must be a non-empty str")
        if isinstance(target, str) and ":" not in target:
            raise InvalidArgumentError(f"target {target!r} must look like 'module:Class'")
        if name in self._entries and not replace:
            existing = self._entries[name]
            raise BackendRegistrationError(
                f"backend {name!r} is already registered ({existing.origin}: "
                f"{existing.target_path}); pass replace=True to replace it"
            )
        if isinstance(target, type):
            schemes = schemes or target.url_schemes
        self._entries[name] = BackendEntry(name, target, "registered at run time", schemes)
        self._loaded.pop(name, None)
        self._conflicts.pop(name, None)

    def entries(self) -> list[BackendEntry]:
        self._read_entry_points()
        return sorted(self._entries.values(), key=lambda e: e.name)

    def load(self, name: str) -> type[StorageBackend]:
        """The backend class registered as ``name``, importing it if needed."""
        self._read_entry_points()
        if name in self._loaded:
            return self._loaded[name]
        if name in self._conflicts:
            raise BackendRegistrationError(self._conflicts[name])
        entry = self._entries.get(name)
        if entry is None:
            raise BackendNotFoundError(f"no backend named {name!r}. {self._available()}")
        cls = entry.target if isinstance(entry.target, type) else self._import(entry)
        if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
            raise BackendLoadError(
                f"backend {name!r} ({entry.target_path}) is not a StorageBackend subclass"
            )
        self._loaded[name] = cls
        return cls

    def resolve_url(self, url: str) -> tuple[type[StorageBackend], str]:
        """The backend class for ``url`` and the URL it should be given.

        ``name+inner://...`` picks backend ``name`` explicitly and hands it ``inner://...``.
        Otherwise the scheme is looked up as a backend name, then among declared schemes.
        """
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgumentError(f"not a backend URL: {url!r} (expected scheme://...)")
        # Not urlsplit: it drops a scheme that starts with a digit ("3fs://").
        scheme = url.split("://", 1)[0].lower()
        if "+" in scheme:
            name, _, inner = scheme.partition("+")
            return self.load(name), inner + url[len(scheme) :]
        self._read_entry_points()
        if scheme in self._entries:
            return self.load(scheme), url
        for entry in self.entries():
            if scheme in entry.schemes:
                return self.load(entry.name), url
        # A plugin may declare its schemes only on its class: import entry points to ask.
        for entry in self.entries():
            if entry.origin.startswith("entry point") and entry.name not in self._loaded:
                try:
                    cls = self.load(entry.name)
                except (BackendLoadError, BackendRegistrationError):
                    continue
                if scheme in cls.url_schemes:
                    return cls, url
        hint = _INSTALL_HINTS.get(scheme)
        install = f" To get one: {hint}." if hint else ""
        raise BackendNotFoundError(
            f"no backend handles URL scheme {scheme!r}.{install} {self._available()}"
        )

    async def open(self, url: str, **config: Any) -> StorageBackend:
        """Open the backend for ``url``; keyword arguments override the URL's options."""
        cls, backend_url = self.resolve_url(url)
        return await cls.open(cls.config_from_url(backend_url, config))

    def _import(self, entry: BackendEntry) -> Any:
        module_name, _, attr = entry.target_path.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f" Install it with: {entry.install_hint}." if entry.install_hint else ""
            raise BackendLoadError(
                f"backend {entry.name!r} could not be imported ({exc}).{hint}"
            ) from exc
        try:
            return getattr(module, attr)
        except AttributeError:
            raise BackendLoadError(
                f"backend {entry.name!r}: {module_name} has no attribute {attr!r}"
            ) from None

    def _read_entry_points(self) -> None:
        if self._entry_points_read or self._group is None:
            return
        self._entry_points_read = True
        for ep in importlib.metadata.entry_points(group=self._group):
            dist = getattr(ep, "dist", None)
            origin = f"entry point ({dist.name} {dist.version})" if dist else "entry point"
            existing = self._entries.get(ep.name)
            if existing is not None:
                if existing.target_path != ep.value:
                    self._conflicts[ep.name] = (
                        f"backend name {ep.name!r} is claimed by {existing.target_path} "
                        f"({existing.origin}) and by {ep.value} ({origin}); "
                        "uninstall one or register it under another name"
                    )
                continue
            self._entries[ep.name] = BackendEntry(ep.name, ep.value, origin)

    def _available(self) -> str:
        rows = []
        for entry in self.entries():
            schemes = ", ".join(f"{s}://" for s in entry.schemes) or f"{entry.name}://"
            hint = f" [{entry.install_hint}]" if entry.install_hint else ""
            rows.append(f"{entry.name} ({schemes}){hint}")
        return "Registered: " + "; ".join(rows)

    def __iter__(self) -> Iterator[BackendEntry]:
        return iter(self.entries())


default_registry = BackendRegistry()


def register_backend(
    name: str,
    target: str | type[StorageBackend],
    *,
    schemes: tuple[str, ...] = (),
    replace: bool = False,
) -> None:
    """Register a backend in the default registry (see :meth:`BackendRegistry.register`)."""
    default_registry.register(name, target, schemes=schemes, replace=replace)


def get_backend_class(name: str) -> type[StorageBackend]:
    return default_registry.load(name)


def list_backends() -> list[BackendEntry]:
    return default_registry.entries()


async def open_backend(url: str, **config: Any) -> StorageBackend:
    """Open a backend by URL, e.g. ``await open_backend("file:///var/cache/hicache")``."""
    return await default_registry.open(url, **config)
