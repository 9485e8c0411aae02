"""Corrupt L3 pages are repaired: found on read, deleted, never vouched for by ``exists``
again, and rewritten by the next backup of the key."""

from __future__ import annotations

import pathlib

from gated_kit import seed_l3, start_prefetch, tokens
from tier_kit import Harness

from hicache.backends.memory import MemoryBackend
from hicache.backends.wrappers import FaultConfig, FaultInjectionBackend, Operation
from hicache.codec import HEADER_SIZE, verify_page
from hicache.errors import CodecError
from hicache.tiering.common.config import PrefetchConfig
from hicache.tiering.common.policies import PrefetchStopPolicy

SEQ = tokens(1, 8)  # 8 pages
WAIT = PrefetchConfig(stop_policy=PrefetchStopPolicy.WAIT_COMPLETE, threshold_tokens=4)


def stored(root: pathlib.Path) -> dict[str, pathlib.Path]:
    return {p.name: p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")}


def damaged(root: pathlib.Path) -> list[str]:
    bad = []
    for key, path in stored(root).items():
        try:
            verify_page(key, path.read_bytes())
        except CodecError:
            bad.append(key)
    return bad


def flip(path: pathlib.Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_one_pass_over_a_damaged_store_leaves_no_corrupt_page(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "l3"
    async with await Harness.build(url=f"file://{root}", prefetch=WAIT) as h:
        await seed_l3(h, SEQ)
        keys = sorted(stored(root))
        assert len(keys) == 8 and not damaged(root)
        flip(stored(root)[keys[1]], HEADER_SIZE + 5)  # payload bits
        flip(stored(root)[keys[6]], 20)  # header bits
        assert len(damaged(root)) == 2
        op = start_prefetch(h, "r", SEQ)
        await h.tree.quiesce(5.0)
        counts = h.controller.metrics.counts
        assert op.completed_pages < 8  # the hit ended at the first bad page
        # Both bad objects were found in the one read, though the hit ended at the first.
        assert counts["corrupt_pages"] == 2 and counts["corrupt_removed"] == 2
        assert len(stored(root)) == 6 and len(h.controller.storage.suspects) == 2
        h.run_request("r", SEQ)  # recomputes the rest and writes it through
        await h.tree.quiesce(5.0)
        assert len(stored(root)) == 8 and not damaged(root)
        assert len(h.controller.storage.suspects) == 0
    # A restart hits it all.
    async with await Harness.build(url=f"file://{root}", prefetch=WAIT) as fresh:
        op = start_prefetch(fresh, "r", SEQ)
        await fresh.tree.quiesce(5.0)
        assert op.completed_pages == 8
        assert fresh.run_request("r", SEQ)["computed"] == 0  # check_prefix verified the KV


async def test_exists_never_vouches_for_a_page_seen_corrupt() -> None:
    # The delete of the bad object fails, so L3 still holds it and `exists` says yes.
    inner = MemoryBackend()
    backend = FaultInjectionBackend(inner, FaultConfig())
    async with await Harness.build(backend=backend, prefetch=WAIT) as h:
        await seed_l3(h, SEQ)
        backend.set_faults(
            FaultConfig(operations=frozenset({Operation.GET}), corrupt_rate=1.0, seed=1)
        )
        start_prefetch(h, "r", SEQ)
        await h.tree.quiesce(5.0)
        suspects = h.controller.storage.suspects
        assert len(suspects) >= 1
        backend.set_faults(FaultConfig(operations=frozenset({Operation.DELETE}), fail_rate=1.0))
        written = h.controller.metrics.counts["pages_written_l3"]
        h.run_request("r", SEQ)
        await h.tree.quiesce(5.0)
        rewritten = h.controller.metrics.counts["pages_written_l3"] - written
        assert rewritten >= 1 and len(suspects) == 0  # suspect pages were written, not skipped
        backend.set_faults(FaultConfig())
        h.tree.evict(10**6)
        h.tree.host_evictor.evict(10**6)
        op = start_prefetch(h, "r2", SEQ)
        await h.tree.quiesce(5.0)
        assert op.completed_pages == 8
