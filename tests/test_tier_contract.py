"""One declared way into the tiered cache: :class:`hicache.tiering.contract.TieredCache`.

Outside ``hicache/tiering/`` nothing reaches into the cache's parts: the AST of every module is
walked for an attribute named like one of them (``x.prefetcher``, ``x.storage``, ...), whatever
``x`` is. ``backends/`` and ``layouts/`` sit below ``tiering`` in the layers
(``tests/test_import_graph.py``), so they cannot hold a cache; ``tools/`` is left out for now
(issue 46: its benches are being reorganised). And the cache is what the contract says it is.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig
from hicache.tiering.contract import TieredCache
from hicache.tiering.controller import HiCacheController

ROOT = Path(__file__).resolve().parent.parent
PARTS = frozenset(
    {"prefetcher", "backups", "host_evictor", "writer", "storage", "controller", "bundler"}
)
# (file, expression) pairs where the name is something else, or a shim kept for tools/.
ALLOWED = {
    # HiCacheConfig.storage: the config's L3 section, not the cache's storage tier
    ("hicache/serving/setup.py", "hicache.storage"),
    # ServingSetup.controller: kept for tools/serve and tests until they use the contract
    ("hicache/serving/setup.py", "self.cache.controller"),
}


def reach_ins() -> list[tuple[str, int, str]]:
    """(file, line, expression) of every attribute named like a part outside the tiering."""
    found = []
    for path in sorted((ROOT / "hicache").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("hicache/tiering/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Attribute) and node.attr in PARTS:
                found.append((rel, node.lineno, ast.unparse(node)))
    return sorted(found)


def test_nothing_outside_the_tiering_reaches_into_the_cache_s_parts() -> None:
    bad = [f"{p}:{line}: {expr}" for p, line, expr in reach_ins() if (p, expr) not in ALLOWED]
    why = "past the tiered cache's contract (hicache/tiering/contract.py):"
    assert not bad, "\n".join([why, *bad])


def test_every_allowance_is_still_needed() -> None:
    stale = ALLOWED - {(p, expr) for p, _, expr in reach_ins()}
    assert not stale, f"allowed but gone, drop them: {sorted(stale)}"


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


async def test_a_tiered_cache_is_a_tiered_cache() -> None:
    model = preset(PoolPreset.DENSE, ModelShape(page_size=4))
    device = device_pools(model, {"kv": 64}, "cpu")
    host = host_pools(model, {"kv": 32})
    controller = await HiCacheController.open(HiCacheConfig(), device, host)
    cache = HiRadixCache(controller, RadixCacheConfig(page_size=4))
    try:
        assert isinstance(cache, TieredCache)
        for name in _members():
            assert hasattr(cache, name), name
    finally:
        await cache.close()
