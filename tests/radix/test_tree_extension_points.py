"""No module outside ``hicache/radix/`` reaches into the tree (issue 46).

Code built on the tree (the tiered cache, its parts, schedulers, tools) uses its public
operations and overrides its public hooks (:mod:`hicache.radix.hooks`). This test reads the
source with ``ast`` and fails on any use, outside ``radix/``, of an attribute whose name starts
with one underscore and that a class of ``radix/`` defines (a method, a ``self._x`` attribute, a
class-level name or a slot), and on any subclass of a ``radix/`` class that defines such a name
of its ancestors (an override of a private hook, or a write of the tree's private state). In a
subclass of the tree, ``self._x`` or ``super()._x`` is flagged too unless the class or a base of
it outside ``radix/`` defines ``_x``: a private step called again is caught even once ``radix/``
has renamed it. Any class may use the private names it defines itself (many have their own
``_clock``).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RADIX = ROOT / "hicache" / "radix"
SCANNED = ("hicache", "backends", "layouts", "tools")  # the installed package's sources


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _base_names(cls: ast.ClassDef) -> list[str]:
    out = []
    for base in cls.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(base, ast.Name):
            out.append(base.id)
        elif isinstance(base, ast.Attribute):
            out.append(base.attr)
    return out


def defined_names(cls: ast.ClassDef) -> set[str]:
    """What ``cls`` defines: methods, class-level names, ``__slots__`` entries, and the
    ``self.x`` attributes its methods assign."""
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__slots__":
                        slots = ast.walk(stmt.value)
                        names.update(str(c.value) for c in slots if isinstance(c, ast.Constant))
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return names


@dataclass
class Classes:
    """Classes by name: their bases and what they define."""

    bases: dict[str, list[str]] = field(default_factory=dict)
    defined: dict[str, set[str]] = field(default_factory=dict)

    def add(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.bases.setdefault(node.name, []).extend(_base_names(node))
                self.defined.setdefault(node.name, set()).update(defined_names(node))


@dataclass
class Radix:
    """The classes of ``radix/``: each one's private names, its own and inherited within
    ``radix/``; and the tree classes (RadixCache and its subclasses there)."""

    private: dict[str, set[str]]
    trees: set[str]

    @classmethod
    def read(cls) -> Radix:
        classes = Classes()
        for path in sorted(RADIX.glob("*.py")):
            classes.add(ast.parse(path.read_text(), filename=str(path)))

        def lineage(name: str) -> set[str]:
            out = {name}
            for base in classes.bases.get(name, []):
                if base in classes.defined and base not in out:
                    out |= lineage(base)
            return out

        private = {
            name: {n for c in lineage(name) for n in classes.defined[c] if _private(n)}
            for name in classes.defined
        }
        return cls(private, {name for name in classes.defined if "RadixCache" in lineage(name)})


def ancestry(
    name: str, classes: Classes, radix: Radix, seen: frozenset[str] = frozenset()
) -> tuple[set[str], set[str], bool]:
    """Of the class ``name`` (outside ``radix/``): the private names of the radix classes it
    derives from, the names its other ancestors define, and whether it derives from a tree."""
    tree_private: set[str] = set()
    other: set[str] = set()
    is_tree = False
    for base in classes.bases.get(name, []):
        if base in radix.private:
            tree_private |= radix.private[base]
            is_tree = is_tree or base in radix.trees
        elif base in classes.bases and base not in seen:
            more, defined, tree = ancestry(base, classes, radix, seen | {name})
            tree_private, other = tree_private | more, other | defined | classes.defined[base]
            is_tree = is_tree or tree
    return tree_private, other, is_tree


def findings(module: ast.Module, filename: str, radix: Radix, known: Classes) -> list[str]:
    """Each use in ``module`` of a tree-private name, as ``file:line: what``. ``known``: the
    classes outside ``radix/`` (of every scanned module), to follow a class's bases."""
    every_private = set().union(*radix.private.values())
    local = Classes()
    local.add(module)
    classes = Classes({**known.bases, **local.bases}, {**known.defined, **local.defined})

    found: list[str] = []

    def flagged(node: ast.Attribute, own: set[str], inherited: set[str], tree: bool) -> bool:
        """Whether ``node`` is a private name of the tree's: in a subclass of the tree, a name on
        ``self`` that the class and its other bases do not define, or on ``super()`` one its
        other bases do not; anywhere, a name a radix class defines and the class does not."""
        value, name = node.value, node.attr
        if not _private(name):
            return False
        if tree and _is_super(value):
            return name not in inherited
        if tree and isinstance(value, ast.Name) and value.id == "self":
            return name not in own | inherited
        return name in every_private and name not in own | inherited

    def visit(node: ast.AST, own: set[str], inherited: set[str], tree: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                tree_private, other, is_tree = ancestry(child.name, classes, radix)
                defined = defined_names(child)
                for name in sorted(defined & tree_private):
                    found.append(f"{filename}:{child.lineno}: {child.name} defines {name}")
                visit(child, defined - tree_private, other - tree_private, is_tree)
                continue
            if isinstance(child, ast.Attribute) and flagged(child, own, inherited, tree):
                found.append(f"{filename}:{child.lineno}: uses .{child.attr}")
            visit(child, own, inherited, tree)

    visit(module, set(), set(), False)
    return found


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def known_classes() -> Classes:
    classes = Classes()
    for path in scanned_modules():
        classes.add(parsed(path))
    return classes


def scanned_modules() -> Iterator[Path]:
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if RADIX not in path.parents:
                yield path


def test_no_module_outside_radix_uses_a_private_member_of_the_tree() -> None:
    radix, known = Radix.read(), known_classes()
    assert {"_touch", "_roots", "_heap", "_new_node"} <= radix.private["ShadowRadixCache"]
    found = [
        hit
        for path in scanned_modules()
        for hit in findings(parsed(path), str(path.relative_to(ROOT)), radix, known)
    ]
    assert not found, "use the tree's public operations (hicache.radix.hooks):\n" + "\n".join(found)


def test_a_private_step_called_or_overridden_by_the_tiered_cache_is_caught() -> None:
    radix, known = Radix.read(), known_classes()
    source = (ROOT / "hicache" / "tiering" / "cache.py").read_text()

    def check(old: str, new: str) -> list[str]:
        assert old in source
        return findings(ast.parse(source.replace(old, new)), "cache.py", radix, known)

    assert check("", "") == []
    # a step of the tree called privately again (whether or not radix/ still defines it)
    walked = check("self.walk(", "self._walk(")  # in match_anchor and insert_anchor
    assert [hit.rpartition(" ")[2] for hit in walked] == ["._walk", "._walk"]
    touched = check("self.touch_path(path, count_hits)", "self._touch(path, 0, 0, True, 0)")
    assert [hit.rpartition(" ")[2] for hit in touched] == ["._touch"]
    # a hook made private again: the override calls the tree's private method
    hook = check("super().split_span(", "super()._split_span(")
    assert [hit.rpartition(" ")[2] for hit in hook] == ["._split_span"]
    # an override of a private step of the tree
    override = check("def split_span(", "def _rebuild_heap(")
    assert any(hit.endswith("HiRadixCache defines _rebuild_heap") for hit in override)


def test_a_class_may_use_the_private_names_it_defines_itself() -> None:
    radix, known = Radix.read(), Classes()

    def check(source: str) -> list[str]:
        return findings(ast.parse(source), "mod.py", radix, known)

    own = (
        "class Source:\n"
        "    def __init__(self, clock):\n"
        "        self._clock = clock\n"
        "    def now(self):\n"
        "        return self._clock()\n"
    )
    assert check(own) == []
    assert check("def roots(tree):\n    return tree._roots\n") == ["mod.py:2: uses ._roots"]
    subclass = (
        "from hicache.radix import RadixCache\n"
        "class Mine(RadixCache):\n"
        "    def __init__(self):\n"
        "        self._mine = 0\n"
        "    def match(self, key):\n"
        "        return self._mine, self._clock(), self._gone()\n"
    )
    assert check(subclass) == ["mod.py:6: uses ._clock", "mod.py:6: uses ._gone"]
