"""URL locations that several backends read the same way."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from hicache.errors import ConfigError

__all__ = ["local_root"]


def local_root(netloc: str, path: str, scheme: str, names: str, example: str) -> dict[str, Any]:
    """``{"root": path}`` of a ``scheme:///abs/path`` URL, whose host may only be
    ``localhost``; the errors say the URL ``names`` such a path and show ``example``."""
    if netloc not in ("", "localhost"):
        raise ConfigError(f"a {scheme} URL names {names}, not {netloc!r}")
    if not path:
        raise ConfigError(f"a {scheme} URL needs a path, for example {example}")
    return {"root": unquote(path)}
