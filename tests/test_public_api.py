"""``import hicache``: every exported name resolves, the import is cheap, and a tiered cache can
be built from pools and a config alone (no serving package) and round-trips a page through L3."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import hicache

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_every_exported_name_resolves() -> None:
    for name in hicache.__all__:
        assert getattr(hicache, name) is not None, name
    assert sorted(hicache.__all__) == sorted(hicache._EXPORTS)  # one list, kept in step
    assert set(hicache.__all__) <= set(dir(hicache))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = hicache.nope  # type: ignore[attr-defined]


def test_exports_are_the_defining_objects() -> None:
    from hicache.backends.registry import open_backend
    from hicache.tiering.cache import HiRadixCache

    assert hicache.HiRadixCache is HiRadixCache
    assert hicache.open_backend is open_backend


def test_read_only_store_error_lives_in_errors_and_is_still_importable_from_base() -> None:
    from hicache.backends import base
    from hicache.errors import BackendError, ReadOnlyStoreError

    assert hicache.ReadOnlyStoreError is ReadOnlyStoreError is base.ReadOnlyStoreError
    assert ReadOnlyStoreError.__module__ == "hicache.errors"
    assert issubclass(ReadOnlyStoreError, BackendError)


def test_import_hicache_imports_neither_torch_nor_the_serving_loop() -> None:
    code = (
        "import sys, hicache; hicache.RadixKey; hicache.open_backend; hicache.HiCacheError;"
        "bad = [m for m in ('torch', 'hicache.serving', 'hicache.tiering') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_readme_tour_runs_with_import_hicache_only(tmp_path: pathlib.Path) -> None:
    match = re.search(r"## A five-minute tour\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert match is not None, "the README has no tour"
    code = match.group(1)
    imports = {line for line in code.splitlines() if line.startswith(("import ", "from "))}
    assert imports == {"import asyncio", "import hicache"}
    code = code.replace("/tmp/", f"{tmp_path}/")
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path
    ).stdout.splitlines()
    assert out[-1] == "64 16.0"  # 64 tokens matched; 16 pages of 4 tokens written to L3


_ROUND_TRIP = """
import asyncio, sys, torch, hicache

async def main(l3):
    pools = hicache.preset(hicache.PoolPreset.DENSE, hicache.ModelShape(page_size=4))
    device = hicache.device_pools(pools, {"kv": 64}, "cpu")
    host = hicache.host_pools(pools, {"kv": 16})
    prefetch = hicache.PrefetchConfig(threshold_tokens=4)
    config = hicache.HiCacheConfig(prefetch=prefetch, storage=hicache.StorageConfig(url=l3))
    cache = await hicache.HiRadixCache.open(config, device, host)
    kv = device["kv"].buffer
    key = hicache.RadixKey(list(range(32)))
    slots = device["kv"].alloc(32)
    kv[:, :, slots] = torch.randn(kv[:, :, slots].shape).to(kv.dtype)
    written = kv[:, :, slots].clone()
    cache.insert(key, slots)
    await cache.quiesce()
    cache.evict(32)
    cache.host_evictor.evict(32)
    assert cache.total_size == 0 and not cache.all_nodes()
    match = cache.match_prefix(key)
    assert cache.prefetcher.start("r", key, match)
    await cache.quiesce()
    match = cache.match_prefix(key)
    assert match.host_hit_length == 32, match.host_hit_length
    loaded, _ = cache.init_load_back(match.last_host_node)
    for load in cache.ready_to_load_host_cache():
        load.synchronize()
    assert torch.equal(kv[:, :, loaded], written)
    await cache.close()
    assert "hicache.serving" not in sys.modules

asyncio.run(main(sys.argv[1]))
"""


def test_tiered_cache_from_pools_and_config_round_trips_through_l3(tmp_path: pathlib.Path) -> None:
    url = f"file://{tmp_path / 'l3'}?fsync=false"
    # In a fresh interpreter, so that the check that no serving module was imported means it.
    subprocess.run([sys.executable, "-c", _ROUND_TRIP, url], check=True)
