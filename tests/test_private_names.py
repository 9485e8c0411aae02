"""No package uses another package's private names (issue 46).

A package is a folder of the installed ``hicache`` (``hicache.tiering``, ``hicache.backends``
from ``backends/``, ``hicache.tools`` from ``tools/``, ...), a subpackage counting with its
folder (``hicache.backends.redis`` is ``hicache.backends``); the root's leaf modules and the
facade are one more (``hicache``). A name is private when it starts with one underscore: a
module (``_io_threads``), or a function, class, constant or attribute. What one package shares
with another it names publicly.

The source is read with ``ast`` (modules as ``tests/test_import_graph.py`` maps them; the
example plugin in ``examples/`` counts as a package of its own). Flagged, anywhere in a module:

* ``import hicache.x._m`` and ``from hicache.x._m import ...`` of another package's private
  module, and ``from hicache.x.m import _name`` of another package's private member or module;
* an attribute read through a module bound by an import (``m._name`` after
  ``from hicache.x import m`` or ``import hicache.x.m as m``; ``hicache.x._m.f`` after
  ``import hicache.x._m``).

Private attributes of objects (``obj._x`` where ``obj`` is another package's instance) need
types to be told apart from an object's own, so they are not checked here; the radix tree's are
(``tests/radix/test_tree_extension_points.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import FACADE, ROOT, imported_from, layer_of, module_files

EXAMPLES = ROOT / "examples"
OUTSIDE = "(examples)"  # the example plugin's package: every hicache name it uses is foreign


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


class Owners:
    """Which package each module of the installed package belongs to."""

    def __init__(self, known: dict[str, Path]) -> None:
        self.known = known

    def module_of(self, dotted: str) -> str | None:
        """The longest prefix of ``dotted`` that is a hicache module, or None."""
        while dotted and dotted not in self.known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def package(self, module: str) -> str:
        layer = layer_of(module, self.known)
        return FACADE if layer in ("(root)", "(facade)") else layer

    def package_of_importer(self, module: str) -> str:
        """``module``'s package, also for a module not on disk (this test's own samples)."""
        if module in self.known:
            return self.package(module)
        parent = module.rpartition(".")[0]
        return self.package(parent) if parent in self.known else OUTSIDE

    def foreign_private(self, dotted: str, importer: str) -> str | None:
        """The private part of ``dotted`` (a module path, or a module's member) when its
        module is another package's than ``importer``'s; else None."""
        module = self.module_of(dotted)
        if module is None or self.package(module) == importer:
            return None
        rest = dotted[len(module) :].lstrip(".").split(".")[:1]  # the member after the module
        parts = [*module.split(".")[1:], *(p for p in rest if p)]
        return next((p for p in parts if _private(p)), None)


def _module_aliases(tree: ast.AST, module: str, path: Path, owners: Owners) -> dict[str, str]:
    """Local name -> the hicache module it is bound to by an import."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None:
                    aliases[alias.asname] = alias.name
                else:  # `import hicache.x.m` binds `hicache`; attributes spell the rest
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = imported_from(module, path, node)
            for alias in node.names:
                child = f"{source}.{alias.name}"
                if child in owners.known:
                    aliases[alias.asname or alias.name] = child
    return {
        name: target
        for name, target in aliases.items()
        if target == FACADE or target.startswith(f"{FACADE}.")
    }


def _dotted(node: ast.Attribute) -> tuple[str, str] | None:
    """(root name, ``root.a.b``) of an attribute chain on a plain name, else None."""
    parts: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if not isinstance(current, ast.Name):
        return None
    return current.id, ".".join(reversed(parts))


def uses(module: str, path: Path, source: str, owners: Owners) -> list[str]:
    """``line: name`` of each of another package's private names ``module`` uses."""
    importer = owners.package_of_importer(module)
    tree = ast.parse(source, filename=str(path))
    aliases = _module_aliases(tree, module, path, owners)
    found: list[tuple[int, str]] = []

    def check(line: int, dotted: str) -> None:
        if owners.foreign_private(dotted, importer) is not None:
            found.append((line, dotted))

    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            source_module = imported_from(module, path, node)
            for alias in node.names:
                check(node.lineno, f"{source_module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and id(node) not in inner:  # whole chains only
            chain = _dotted(node)
            if chain is not None and chain[0] in aliases:
                check(node.lineno, f"{aliases[chain[0]]}.{chain[1]}")
    return [f"{line}: {dotted}" for line, dotted in sorted(set(found))]


def _sources() -> dict[str, Path]:
    """Module name -> file: the installed package's, then the example plugin's."""
    files = dict(module_files())
    for path in sorted(EXAMPLES.rglob("*.py")):
        files[f"examples.{path.relative_to(EXAMPLES).with_suffix('').as_posix()}"] = path
    return files


def test_no_package_uses_another_package_s_private_names() -> None:
    owners = Owners(module_files())
    bad = [
        f"{path.relative_to(ROOT)}:{use}"
        for module, path in _sources().items()
        for use in uses(module, path, path.read_text(), owners)
    ]
    why = "another package's private names (make them public, or move them):"
    assert not bad, "\n".join([why, *bad])


def test_the_check_flags_imports_and_module_attributes_not_a_package_s_own() -> None:
    owners = Owners(module_files())
    tools = ROOT / "tools" / "x.py"
    source = """
import hicache.backends._io_threads
import hicache.layouts.views as views
from hicache.backends import _io_threads as threads
from hicache.backends.nixl import backend
from hicache.backends.disk.config import DiskConfig, _MAX_DEFAULT_THREADS
from hicache.tools.cli import _private_helper

hicache.backends._io_threads.outlive_cancel
views._PinnedHostMemory, views.host_on_device, backend.QUEUE_PARAMS
DiskConfig()._own_attribute
"""
    found = uses("hicache.tools.x", tools, source, owners)
    assert found == [
        "2: hicache.backends._io_threads",
        "4: hicache.backends._io_threads",
        "6: hicache.backends.disk.config._MAX_DEFAULT_THREADS",
        "9: hicache.backends._io_threads.outlive_cancel",
        "10: hicache.layouts.views._PinnedHostMemory",
    ]
    # The same imports from inside the package that owns them are its own business.
    own = "from hicache.backends._io_threads import IOThreads\n"
    assert uses("hicache.backends.x", ROOT / "backends" / "x.py", own, owners) == []
