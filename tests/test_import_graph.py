"""No import circles in hicache: not between files, not between packages; and the folders
form layers (LAYERS), each importing only from itself and those below it.

The graph is read from the source with ``ast``, every ``import`` counted wherever it stands
(module level, inside a function, under ``TYPE_CHECKING``): a circle hidden behind
``TYPE_CHECKING`` or a late import is still two modules that cannot be understood apart.

Nodes are modules as installed (``backends/`` is ``hicache.backends``, ``layouts/`` is
``hicache.layouts``, ``tools/`` is ``hicache.tools``). ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``). A package's folder is
its node in the package graph; the root's ``__init__`` (the public facade, which nothing inside
imports) stands apart from the root's leaf modules (keys, codec, errors, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package it is installed as
SOURCES = {
    "hicache": "hicache",
    "backends": "hicache.backends",
    "layouts": "hicache.layouts",
    "tools": "hicache.tools",
}
FACADE = "hicache"


def module_files() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    found: dict[str, Path] = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_from(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of the module ``from X import ...`` in ``module`` (at ``path``) names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if _is_package(path) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The hicache modules that ``module`` imports, anywhere in its source."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = imported_from(module, path, node)
            for alias in node.names:
                child = f"{source}.{alias.name}"
                targets.add(child if child in known else source)
    edges = set()
    for target in targets:
        # `import hicache.a.b` names the module hicache.a.b; keep the longest known prefix
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != module:
            edges.add(target)
    return edges


def module_graph() -> dict[str, set[str]]:
    known = module_files()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def package_of(module: str, known: dict[str, Path]) -> str:
    if module == FACADE:
        return f"{FACADE} (facade)"
    return module if _is_package(known[module]) else module.rpartition(".")[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    known = module_files()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module, known)
        edges = packages.setdefault(source, set())
        edges.update(p for t in targets if (p := package_of(t, known)) != source)
    return packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_circle(graph, members) for members in components]


def _one_circle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest path from the component's first member back to itself, for the message."""
    inside = set(members)
    start = members[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & inside):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    return members


def _describe(found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(circle) for circle in found)


def test_no_circle_between_files() -> None:
    found = cycles(module_graph())
    assert not found, f"import circles between files:\n{_describe(found)}"


def test_no_circle_between_packages() -> None:
    found = cycles(package_graph(module_graph()))
    assert not found, f"import circles between packages:\n{_describe(found)}"


# The folders of hicache, lowest first: a module imports only from its own folder and those
# before it. "(root)" is the root's leaf modules (errors, keys, codec, urls, ...); the facade
# (hicache/__init__) comes last. A subpackage counts with its folder (models.hf is models).
LAYERS = (
    "(root)", "layouts", "backends", "pools", "radix", "tiering", "models", "sparse",
    "scheduling", "serving", "workloads", "server", "integrations", "tools", "(facade)",
)  # fmt: skip


def layer_of(module: str, known: dict[str, Path]) -> str:
    """The folder of LAYERS ``module`` belongs to."""
    if module == FACADE:
        return "(facade)"
    parts = module.split(".")
    if len(parts) == 2 and not _is_package(known[module]):
        return "(root)"
    return parts[1]


def upward_imports(graph: dict[str, set[str]], known: dict[str, Path]) -> list[str]:
    """``module -> target`` for each import of a folder later in LAYERS than the module's."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    found = []
    for module, targets in sorted(graph.items()):
        own = rank[layer_of(module, known)]
        found += [f"{module} -> {t}" for t in sorted(targets) if rank[layer_of(t, known)] > own]
    return found


def test_every_folder_is_a_layer() -> None:
    known = module_files()
    assert {layer_of(m, known) for m in known} <= set(LAYERS), "a folder missing from LAYERS"


def test_no_folder_imports_a_later_layer() -> None:
    known = module_files()
    found = upward_imports(module_graph(), known)
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_the_layer_check_counts_a_subpackage_with_its_folder() -> None:
    """models.hf importing workloads is models importing workloads: against the order."""
    known = {
        "hicache.models": Path("hicache/models/__init__.py"),
        "hicache.models.hf.tokenizer": Path("hicache/models/hf/tokenizer.py"),
        "hicache.workloads.traces": Path("hicache/workloads/traces.py"),
    }
    graph = {"hicache.models.hf.tokenizer": {"hicache.workloads.traces"}}
    assert upward_imports(graph, known) == [
        "hicache.models.hf.tokenizer -> hicache.workloads.traces"
    ]


def test_the_checker_sees_a_circle_behind_type_checking(tmp_path: Path) -> None:
    """The checker itself: a TYPE_CHECKING import back is a circle, a one-way import is not."""
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (tmp_path / "b.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    known = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abc"}
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    del graph["pkg.b"]
    assert cycles({**graph, "pkg.b": set()}) == []
