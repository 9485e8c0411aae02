"""A damaged L3 is repaired by one more pass of the same workload (issue 37).

The campaign: serve a workload into a file L3, damage pages in ten ways at every position of
their prefixes (past the first prefetch read batch too), serve the same workload again, then
check every stored object through the codec. A prefetch ends its hit at the first bad page, so
the pages after it are computed without ever being read: ``exists`` alone would keep their
bad copies. Every damaged page the second pass touches must be good again, no good page
rewritten, and ``l3_repaired_pages`` must count the rewrites. A prompt the second pass does
not serve keeps its damaged pages: ``hicache verify`` reports them and ``compact`` removes them.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import torch
from serving_kit import VOCAB, Sequential, hicache_config, serve

from hicache.backends.registry import open_backend
from hicache.codec import HEADER_SIZE, verify_page
from hicache.errors import CodecError
from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode
from hicache.tiering.common.config import HiCacheConfig
from hicache.tiering.common.policies import PrefetchStopPolicy
from hicache.tools.store.compact import CompactOptions, compact_store
from hicache.tools.store.verify import VerifyOptions, verify_store

DOCS = 4  # served by both passes
UNTOUCHED = 1  # one more prompt, served by the first pass only
DOC_PAGES = 48  # past two prefetch read batches of 32 pages
PAGE = 4
DEVICE_TOKENS = 1024


def _flip(offset: int) -> Callable[[bytes, bytes], bytes]:
    def damage(data: bytes, _other: bytes) -> bytes:
        out = bytearray(data)
        out[offset] ^= 0x01
        return bytes(out)

    return damage


# Ten kinds of damage: (page bytes, another valid page's bytes) -> damaged bytes.
DAMAGE: dict[str, Callable[[bytes, bytes], bytes]] = {
    "payload": _flip(HEADER_SIZE + 7),
    "last_byte": _flip(-1),
    "header_keeping_magic": _flip(20),  # inside the key digest
    "magic": _flip(0),
    "checksum_field": _flip(124),  # the stored payload's checksum
    "half": lambda data, _other: data[: len(data) // 2],
    "inside_header": lambda data, _other: data[: HEADER_SIZE // 2],
    "empty": lambda _data, _other: b"",
    "appended": lambda data, _other: data + b"\x00\x01\x02",
    "swapped": lambda _data, other: other,
}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(37)
    return [
        torch.randint(0, VOCAB, (DOC_PAGES * PAGE,), generator=gen).tolist()
        for _ in range(DOCS + UNTOUCHED)
    ]


def _config(root: pathlib.Path) -> HiCacheConfig:
    """A file L3 in ``root``; prefetches read every page L3 holds (the default batches)."""
    config = hicache_config(root, stop_policy=PrefetchStopPolicy.WAIT_COMPLETE)
    return config.with_changes("prefetch", threshold_tokens=PAGE, batch_pages=32)


def _stored(root: pathlib.Path) -> dict[str, pathlib.Path]:
    return {p.name: p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")}


def _is_good(key: str, path: pathlib.Path) -> bool:
    try:
        verify_page(key, path.read_bytes())
    except CodecError:
        return False
    return True


def _chains(root: pathlib.Path) -> list[list[str]]:
    """Each prompt's keys in page order, from the page headers' chain positions."""
    by_parent: dict[bytes, str] = {}
    for key, path in _stored(root).items():
        head = path.read_bytes()[:HEADER_SIZE]
        by_parent[head[28:60]] = key
    chains = []
    for key in (k for k, p in _stored(root).items() if p.read_bytes()[28:60] == bytes(32)):
        chain = [key]
        while (nxt := by_parent.get(bytes.fromhex(chain[-1].rsplit("-", 1)[1]))) is not None:
            chain.append(nxt)
        chains.append(chain)
    return chains


def _damage(root: pathlib.Path, chains: list[list[str]]) -> set[str]:
    """Damage page ``p`` of prompt ``d`` when ``p % DOCS == d``: every position of a prefix is
    damaged in one prompt, every kind at many positions. The keys damaged."""
    assert len(chains) == DOCS + UNTOUCHED and min(map(len, chains)) >= DOC_PAGES
    paths, kinds = _stored(root), list(DAMAGE.values())
    donor = paths[chains[0][1]].read_bytes()  # a valid page of another key (never damaged)
    damaged = set()
    for d, chain in enumerate(chains):
        for p in range(d % DOCS, len(chain), DOCS):
            path = paths[chain[p]]
            path.write_bytes(kinds[len(damaged) % len(kinds)](path.read_bytes(), donor))
            damaged.add(chain[p])
    return damaged


async def test_one_more_pass_repairs_every_damaged_page_and_only_those(
    tmp_path: pathlib.Path,
) -> None:
    root, prompts = tmp_path / "l3", _prompts()
    config = _config(root)
    first = await serve(
        ModelPreset.DENSE, CacheMode.DEVICE_HOST_L3, Sequential(prompts), config, DEVICE_TOKENS
    )
    assert not first.errors and len(_stored(root)) >= DOCS * DOC_PAGES
    chains = _chains(root)
    damaged = _damage(root, chains)
    assert len(damaged) * DOCS >= len(_stored(root)) - DOCS
    assert {k for k, p in _stored(root).items() if not _is_good(k, p)} == damaged
    before = {k: p.stat() for k, p in _stored(root).items() if k not in damaged}

    again = await serve(
        ModelPreset.DENSE, CacheMode.DEVICE_HOST_L3, Sequential(prompts[:DOCS]), config,
        DEVICE_TOKENS,
    )  # fmt: skip
    assert not again.errors and again.outputs == {r: first.outputs[r] for r in again.outputs}
    stored = _stored(root)
    assert set(stored) == set(before) | damaged  # deleted bad copies were written again
    left = {k for k, p in stored.items() if not _is_good(k, p)}
    # What stays bad is exactly the damage of the prompt the second pass never served.
    untouched = [damaged & set(chain) for chain in chains if set(chain) & left]
    assert left and untouched == [left]
    rewritten = [
        k
        for k, st in before.items()
        if (stored[k].stat().st_ino, stored[k].stat().st_mtime_ns) != (st.st_ino, st.st_mtime_ns)
    ]
    assert rewritten == []  # good pages were left alone
    assert again.metrics["l3_repaired_pages"] == len(damaged) - len(left)
    assert again.metrics["pages_written_l3"] == len(damaged) - len(left)
    assert again.metrics["pages_checked_l3"] > 0

    backend = await open_backend(f"file://{root}")
    try:
        report = await verify_store(backend, VerifyOptions())
        assert {bad.key for bad in report.bad} == left
        await compact_store(backend, CompactOptions(grace_s=0))
        assert (await verify_store(backend, VerifyOptions())).bad == []
        assert not set(_stored(root)) & left
    finally:
        await backend.close()
