"""The repair campaign of issue 37 on a ``disk://`` L3: records damaged inside segments, at
every position of their prefixes, are rewritten by one more pass of the same workload.

On this store a damaged record never reaches the codec: the store checks each record's
payload against the xxh3 in its header, and reports a bad one as a miss. So a copy the
second pass computes is read back as "absent", and written again, whatever the damage.
"""

from __future__ import annotations

import pathlib

from serving_kit import serve
from test_serving_repair import DEVICE_TOKENS, DOC_PAGES, DOCS, Sequential, _prompts
from test_serving_repair import _config as file_config

from hicache.backends.disk import DiskBackend, DiskConfig
from hicache.backends.disk.format import RECORD_HEADER
from hicache.backends.disk.segments import segment_name
from hicache.codec import verify_page
from hicache.errors import CodecError
from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode


async def _pages(root: pathlib.Path) -> dict[str, bytes | None]:
    store = await DiskBackend.open(DiskConfig(root=str(root), read_only=True))
    try:
        keys = [info.key async for info in store.scan()]
        return dict(zip(keys, await store.get(keys), strict=True))
    finally:
        await store.close()


def _chains(pages: dict[str, bytes | None]) -> list[list[str]]:
    """Each prompt's keys in page order, from the page headers' parent digests."""
    by_parent = {data[28:60]: key for key, data in pages.items() if data is not None}
    chains = []
    for key in (k for k, d in pages.items() if d is not None and d[28:60] == bytes(32)):
        chain = [key]
        while (nxt := by_parent.get(bytes.fromhex(chain[-1].rsplit("-", 1)[1]))) is not None:
            chain.append(nxt)
        chains.append(chain)
    return chains


async def _damage(root: pathlib.Path, chains: list[list[str]]) -> set[str]:
    """Flip a byte of page ``p`` of prompt ``d`` when ``p % DOCS == d``, in its segment: in the
    payload, the page header, or the record's own header, by turns."""
    store = await DiskBackend.open(DiskConfig(root=str(root), read_only=True))
    entries = {k: store.catalog.index.get(k) for chain in chains for k in chain}
    await store.close()
    damaged = set()
    for d, chain in enumerate(chains):
        for p in range(d % DOCS, len(chain), DOCS):
            key = chain[p]
            code, offset, length, _ = entries[key]  # type: ignore[misc]
            body = offset + RECORD_HEADER + len(key)
            where = (body + length // 2, body + 3, offset + 20)[len(damaged) % 3]
            with open(root / "segments" / segment_name(code), "r+b") as f:
                f.seek(where)
                byte = f.read(1)[0]
                f.seek(where)
                f.write(bytes([byte ^ 0x01]))
            damaged.add(key)
    return damaged


def _good(key: str, data: bytes | None) -> bool:
    if data is None:
        return False
    try:
        verify_page(key, data)
    except CodecError:
        return False
    return True


async def test_one_more_pass_rewrites_damaged_records(tmp_path: pathlib.Path) -> None:
    root, prompts = tmp_path / "l3", _prompts()
    config = file_config(root).with_changes("storage", url=f"disk://{root}")
    first = await serve(
        ModelPreset.DENSE, CacheMode.DEVICE_HOST_L3, Sequential(prompts), config, DEVICE_TOKENS
    )
    assert not first.errors
    chains = _chains(await _pages(root))
    assert len(chains) == len(prompts) and min(map(len, chains)) >= DOC_PAGES
    damaged = await _damage(root, chains)

    again = await serve(
        ModelPreset.DENSE, CacheMode.DEVICE_HOST_L3, Sequential(prompts[:DOCS]), config,
        DEVICE_TOKENS,
    )  # fmt: skip
    assert not again.errors and again.outputs == {r: first.outputs[r] for r in again.outputs}
    pages = await _pages(root)
    bad = {k for k in damaged if not _good(k, pages.get(k))}
    # What stays bad is the damage of the one prompt the second pass never served.
    untouched = [set(chain) & damaged for chain in chains if set(chain) & bad]
    assert bad and untouched == [bad]
    # The store reads a damaged record as a miss, after exists listed it: a repair.
    assert again.metrics["l3_repaired_pages"] == len(damaged) - len(bad)
    assert again.metrics["pages_written_l3"] == len(damaged) - len(bad)
    assert all(_good(k, d) for k, d in pages.items() if k not in damaged)
