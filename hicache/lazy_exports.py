"""Names a package imports on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` on first use.

    ``exports`` maps a name to the module that defines it, absolute (``hicache.keys``) or
    relative to ``package`` (``.views``). The value is stored in the package, so later lookups
    do not come back here; any other name is an ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
