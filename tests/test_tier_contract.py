"""One declared way into the tiered cache: :class:`hicache.tiering.contract.TieredCache`.

Outside ``hicache/tiering/`` nothing reaches into the cache's parts: the AST of every module of
the installed package (``hicache/``, ``tools/``; ``backends/`` and ``layouts/`` sit below
``tiering`` in the layers, ``tests/test_import_graph.py``, so they cannot hold a cache) is
walked for an attribute named like one of them (``x.prefetcher``, ``x.storage``, ...), whatever
``x`` is. Two readings of such a name are no reach-in, and nothing else is allowed:

* ``self.writer`` in a class that assigns ``self.writer`` itself: its own attribute;
* ``x.storage.url`` (a field of :class:`StorageConfig` that the storage tier has not): the
  config's ``storage`` section, read from a :class:`HiCacheConfig`.

And the cache is what the contract says it is.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from hicache.backends.wrappers import LatencyBackend, LatencyConfig
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, StorageConfig
from hicache.tiering.contract import TieredCache
from hicache.tiering.controller import HiCacheController
from hicache.tiering.l3.storage_tier import StorageTier

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("hicache", "tools")
PARTS = frozenset(
    {"prefetcher", "backups", "host_evictor", "writer", "storage", "controller", "bundler"}
)


def _self_stores(tree: ast.AST) -> set[str]:
    """The ``self.x`` names assigned anywhere in ``tree`` (a class's own attributes)."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


# Fields read only from the config's section ``HiCacheConfig.storage``, never from a tier.
CONFIG_ONLY = frozenset(
    {f.name for f in dataclasses.fields(StorageConfig)}
    - set(dir(StorageTier))
    - _self_stores(ast.parse(inspect.getsource(StorageTier)))
)


class _Finder(ast.NodeVisitor):
    """Part-named attributes of one module, but for a class's own and the config's section."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self._own: list[set[str]] = [set()]  # the enclosing classes' own self.x names
        self._config: set[int] = set()  # ids of `x.storage` nodes read as the config's section

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._own.append(_self_stores(node))
        self.generic_visit(node)
        self._own.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        inner = node.value
        if (
            node.attr in CONFIG_ONLY
            and isinstance(inner, ast.Attribute)
            and inner.attr == "storage"
        ):
            self._config.add(id(inner))
        if node.attr in PARTS and id(node) not in self._config and not self._owned(node):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def _owned(self, node: ast.Attribute) -> bool:
        base = node.value
        return isinstance(base, ast.Name) and base.id == "self" and node.attr in self._own[-1]


def reach_ins(sources: dict[str, str] | None = None) -> list[tuple[str, int, str]]:
    """(file, line, expression) of every reach-in outside the tiering; ``sources`` (file ->
    text) replaces reading the package (for this test's own checks)."""
    if sources is None:
        paths = sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))
        rels = {p.relative_to(ROOT).as_posix(): p for p in paths}
        sources = {rel: p.read_text() for rel, p in rels.items()}
    found = []
    for rel, text in sources.items():
        if rel.startswith("hicache/tiering/"):
            continue
        finder = _Finder()
        finder.visit(ast.parse(text, filename=rel))
        found += [(rel, line, expr) for line, expr in finder.found]
    return sorted(found)


def test_nothing_outside_the_tiering_reaches_into_the_cache_s_parts() -> None:
    bad = [f"{p}:{line}: {expr}" for p, line, expr in reach_ins()]
    why = "past the tiered cache's contract (hicache/tiering/contract.py):"
    assert not bad, "\n".join([why, *bad])


def test_the_check_tells_a_reach_in_from_a_config_and_an_own_attribute() -> None:
    source = """
class Sink:
    def __init__(self):
        self.writer = open("x")

    def close(self, cache, config):
        self.writer.close()
        url = config.storage.url, config.storage.model_id
        return cache.storage.backend, self.cache.writer, cache.controller.storage.enabled
"""
    found = [expr for _, _, expr in reach_ins({"tools/x.py": source})]
    assert found == [
        "cache.controller",
        "cache.controller.storage",
        "cache.storage",
        "self.cache.writer",
    ]
    assert {"url", "model_id"} <= CONFIG_ONLY and "backend" not in CONFIG_ONLY


def _members() -> list[str]:
    return [
        name
        for name in dir(TieredCache)
        if not name.startswith("_") and name not in dir(object) and name != "mro"
    ]


def test_the_cache_declares_every_member_with_its_signature() -> None:
    """Each method of the contract is the cache's with the same parameters and defaults."""
    assert len(_members()) > 30
    for name in _members():
        declared = inspect.getattr_static(TieredCache, name)
        if isinstance(declared, property):
            continue  # an attribute or a property on the cache: the instance test sees it
        has = getattr(HiRadixCache, name)
        assert inspect.iscoroutinefunction(has) == inspect.iscoroutinefunction(declared), name
        want = list(inspect.signature(declared).parameters.values())
        got = list(inspect.signature(has).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got] == [
            (p.name, p.kind, p.default) for p in want
        ], name


async def _cache(config: HiCacheConfig) -> HiRadixCache:
    model = preset(PoolPreset.DENSE, ModelShape(page_size=4))
    device = device_pools(model, {"kv": 64}, "cpu")
    host = host_pools(model, {"kv": 32})
    controller = await HiCacheController.open(config, device, host)
    return HiRadixCache(controller, RadixCacheConfig(page_size=4))


async def test_a_tiered_cache_is_a_tiered_cache() -> None:
    cache = await _cache(HiCacheConfig())
    try:
        assert isinstance(cache, TieredCache)
        for name in _members():
            assert hasattr(cache, name), name
    finally:
        await cache.close()


async def test_wrap_l3_backend_puts_the_wrapper_in_the_backend_s_place() -> None:
    cache = await _cache(HiCacheConfig(storage=StorageConfig(url="memory://")))
    try:
        inner = cache.l3_backend
        assert inner is not None
        assert cache.wrap_l3_backend(lambda backend: LatencyBackend(backend, LatencyConfig()))
        wrapped = cache.l3_backend
        assert isinstance(wrapped, LatencyBackend) and wrapped.inner is inner
    finally:
        await cache.close()
    cache = await _cache(HiCacheConfig())  # no L3: nothing to wrap
    try:
        assert cache.wrap_l3_backend(lambda backend: backend) is False
        assert cache.l3_backend is None
    finally:
        await cache.close()
