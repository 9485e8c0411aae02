"""docs/DESIGN.md's page walk ("A page's walk, from `match_prefix` to disk and back") names
real code, and counts it right.

Paths are named as the section names them: ``backends/...`` and ``layouts/...`` at the
repository's root, everything else under ``hicache/``; ``a/{b,c}.py`` stands for ``a/b.py`` and
``a/c.py``. Checked here, from the text alone:

* every backticked ``.py`` path exists;
* a backticked name right after a path (```tiering/cache.py` `HiRadixCache.insert_anchor```)
  is defined in that file: ``Class.method`` a ``def`` inside ``class Class``, a bare name a
  ``def``, ``class`` or assignment;
* every ``Class.method`` it names is defined in one of the files it names;
* the count in the section's first lines is the length of the list it gives, that list is
  exactly the files the numbered steps name, and the side-case files are not in it.

And once, by running the walk on the CPU (tiny pages, a ``disk://`` store in a temporary
directory, traced with :func:`sys.setprofile`): every counted file runs code on it.
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from hicache.keys import RadixKey
from hicache.pools.device import device_pools
from hicache.pools.host import host_pools
from hicache.pools.presets import ModelShape, PoolPreset, preset
from hicache.pools.req_to_token import ReqToTokenPool
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.tree import RadixCacheConfig
from hicache.tiering.cache import HiRadixCache
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig, TierConfig
from hicache.tiering.controller import HiCacheController

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## A page's walk, from `match_prefix` to disk and back"
AT_ROOT = ("backends/", "layouts/")
TICKS = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")


def _section() -> str:
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start : end if end >= 0 else len(text)]


def _expand(token: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (one brace group at most, as the section has)."""
    m = re.fullmatch(r"([^{}]*)\{([^{}]*)\}([^{}]*)", token)
    if m is None:
        return [token]
    return [m[1] + part + m[3] for part in m[2].split(",")]


def _paths(text: str) -> list[str]:
    """Every backticked ``.py`` path of ``text``, braces expanded, in order."""
    return [p for m in TICKS.finditer(text) if m[1].endswith(".py") for p in _expand(m[1])]


def _file(path: str) -> Path:
    return ROOT / path if path.startswith(AT_ROOT) else ROOT / "hicache" / path


def _named_next_to_files(text: str) -> list[tuple[str, str]]:
    """(path, name) for each backticked name that follows a one-file path, whitespace apart."""
    ticks = list(TICKS.finditer(text))
    pairs = []
    for prev, cur in itertools.pairwise(ticks):
        between = text[prev.end() : cur.start()]
        if between.strip() or not prev[1].endswith(".py") or len(_expand(prev[1])) != 1:
            continue
        if NAME.fullmatch(cur[1]) and not cur[1].endswith(".py"):
            pairs.append((prev[1], cur[1]))
    return pairs


def _defined(source: str, name: str) -> bool:
    """Whether ``name`` (``Class.method`` or a bare name) is defined in ``source``."""
    if "." in name:
        cls, method = name.split(".")
        m = re.search(rf"^class {re.escape(cls)}\b.*$", source, re.M)
        if m is None:
            return False
        body = []
        for line in source[m.end() + 1 :].splitlines():
            if line and not line[0].isspace() and not line.startswith((")", "#")):
                break  # the next top-level statement ends the class
            body.append(line)
        found = re.search(rf"^\s+(async\s+)?def {re.escape(method)}\b", "\n".join(body), re.M)
        return found is not None
    pattern = rf"^\s*((async\s+)?def|class) {re.escape(name)}\b|^{re.escape(name)}\s*[:=]"
    return re.search(pattern, source, re.M) is not None


def _parts(section: str) -> tuple[int, list[str], list[str], str]:
    """(the count given, the counted files, the side-case files, the numbered steps)."""
    intro, _, steps = section.partition("\n1. ")
    counted_text, _, rest = intro.partition("Side cases add")
    side_text, _, _ = rest.partition("Helpers")
    count = re.search(r"(\d+) files", counted_text)
    assert count is not None, "the section's first lines give no 'N files'"
    assert rest, "the section's first lines name no side cases ('Side cases add ...')"
    return int(count[1]), _paths(counted_text), _paths(side_text), "1. " + steps


def test_paths_exist() -> None:
    missing = [p for p in _paths(_section()) if not _file(p).is_file()]
    assert not missing, f"DESIGN.md's page walk names files that do not exist: {missing}"


def test_names_are_defined_in_their_files() -> None:
    pairs = _named_next_to_files(_section())
    assert len(pairs) >= 20, "the page walk should name its functions beside their files"
    wrong = [
        f"{path} {name}"
        for path, name in pairs
        if _file(path).is_file() and not _defined(_file(path).read_text(encoding="utf-8"), name)
    ]
    assert not wrong, f"DESIGN.md's page walk names what these files do not define: {wrong}"


def test_every_class_method_is_in_a_named_file() -> None:
    """``Class.method`` named anywhere in the section, beside a file or not, is defined in one
    of the files the section names."""
    section = _section()
    files = [_file(p) for p in set(_paths(section))]
    sources = [f.read_text(encoding="utf-8") for f in files if f.is_file()]
    methods = {m[1] for m in TICKS.finditer(section) if re.fullmatch(r"[A-Z]\w*\.\w+", m[1])}
    assert len(methods) >= 20
    wrong = sorted(n for n in methods if not any(_defined(src, n) for src in sources))
    assert not wrong, f"DESIGN.md's page walk names methods that none of its files define: {wrong}"


def test_count_matches_the_list_and_the_steps() -> None:
    count, counted, side, steps = _parts(_section())
    assert len(counted) == len(set(counted)), f"a file is counted twice: {counted}"
    assert count == len(counted), f"the section says {count} files but lists {len(counted)}"
    assert not set(side) & set(counted), "a side-case file is counted too"
    named = set(_paths(steps))
    assert named == set(counted), (
        f"named in the steps, not counted: {sorted(named - set(counted))}; "
        f"counted, not named in the steps: {sorted(set(counted) - named)}"
    )


# ----- the walk itself, traced ------------------------------------------------------------------
PAGE = 4


async def _cache(url: str) -> HiRadixCache:
    model = preset(PoolPreset.DENSE, ModelShape(page_size=PAGE))
    anchor = next(s.name for s in model if s.shares_slots_with is None)
    device = device_pools(model, {anchor: 64}, "cpu")
    host = host_pools(model, {anchor: 32})
    config = HiCacheConfig(
        TierConfig(),  # write_through, the default
        PrefetchConfig(threshold_tokens=PAGE),
        StorageConfig(url=url),
    )
    controller = await HiCacheController.open(config, device, host)
    return HiRadixCache(controller, RadixCacheConfig(page_size=PAGE), ReqToTokenPool(4, 64))


def _kv(cache: HiRadixCache) -> torch.Tensor:
    return cache.device.buffer


def _positions(n: int, like: torch.Tensor) -> torch.Tensor:
    """KV whose every item holds its token's position: ``(1, 1, n, 1, ...)`` against ``like``'s
    ``(components, layers, slots, *item)``."""
    return torch.arange(n, dtype=like.dtype).reshape(1, 1, n, *[1] * (like.dim() - 3))


async def _walk(root: Path, tokens: list[int]) -> torch.Tensor:
    """Out: a request's pages to disk://; back: a fresh cache over the same store prefetches
    them and loads them to the device. The KV that came back."""
    url = f"disk://{root}"
    out = await _cache(url)
    slots = out.device.alloc(len(tokens))
    assert slots is not None
    kv = _kv(out)
    kv[:, :, slots] = _positions(len(tokens), kv)
    table = out.req_to_token
    assert table is not None
    row = table.alloc()
    assert row is not None
    table.table[row, : len(tokens)] = slots
    req = CachedRequest("out", tokens, row, kv_len=len(tokens), allocated=len(tokens))
    out.cache_finished_req(req)
    await out.quiesce(10)
    await out.close()

    back = await _cache(url)
    key = RadixKey(tokens)
    match = back.match_prefix(key)
    assert match.prefix_len == 0 and match.host_hit_length == 0
    assert back.prefetch_start("back", key, match)
    await back.quiesce(10)
    match = back.match_prefix(key)
    assert match.host_hit_length == len(tokens), "the prefetch did not bring the pages to host"
    assert match.last_host_node is not None
    loaded, _ = back.init_load_back(match.last_host_node)
    for transfer in back.ready_to_load_host_cache():
        transfer.wait_layer(back.controller.anchor, 0)
        transfer.synchronize()
    got = _kv(back)[:, :, loaded].clone()
    await back.close()
    return got


async def test_every_counted_file_runs_on_the_walk(tmp_path: Path) -> None:
    _, counted, _, _ = _parts(_section())
    ran: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            ran.add(frame.f_code.co_filename)

    tokens = list(range(100, 100 + 3 * PAGE))
    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        got = await _walk(tmp_path / "store", tokens)
    finally:
        sys.setprofile(old)
    want = _positions(len(tokens), got).expand_as(got)
    assert torch.equal(got, want), "the KV that came back differs"
    ran_files = {Path(f).resolve() for f in ran}
    idle = [p for p in counted if _file(p).resolve() not in ran_files]
    assert not idle, f"counted in DESIGN.md's page walk, but no code of theirs ran on it: {idle}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
