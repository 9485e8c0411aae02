"""The engine orders its queue by device and host hits, looking at the tree once a request a round.

A prefix served long ago is on host after later requests filled the device: LPM still admits
the request that reuses it before one with a shorter device hit, and admission takes each
request's prefix with one match, the plan's being a peek kept on the request.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cli_kit import run
from serving_kit import PAGE, VOCAB, hicache_config, tiny_model

from hicache.keys import RadixKey
from hicache.models.config import ModelPreset
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.engine_events import RequestAdmitted
from hicache.serving.request import ServeRequest
from hicache.serving.setup import open_engine
from hicache.tiering.cache import HiRadixCache
from hicache.tools.cli import build_parser
from hicache.tools.serve.config import engine_config_of, router_config_of
from hicache.tools.serve.config import hicache_config as serve_hicache

ONE_AT_A_TIME = EngineConfig(max_running=1, skip_slow_prefetch=False, stall_s=20.0)


class Phased:
    """``first`` one at a time (each arrives when the last finished), then ``together`` all
    at once: the engine sees them in one queue, with whatever ``first`` left in the tree."""

    def __init__(self, first: Sequence[list[int]], together: Sequence[list[int]]) -> None:
        self._first = deque(ServeRequest(f"s{i}", p, 3) for i, p in enumerate(first))
        self.together = [ServeRequest(f"t{i}", p, 3) for i, p in enumerate(together)]
        self._released = False
        self._busy = False

    def due(self, now: float) -> list[ServeRequest]:
        if self._busy:
            return []
        if self._first:
            self._busy = True
            request = self._first.popleft()
        elif not self._released:
            self._released = True
            for request in self.together:
                request.arrival_s = request.record.arrival_s = now
            return list(self.together)
        else:
            return []
        request.arrival_s = request.record.arrival_s = now
        return [request]

    def finished(self, request: ServeRequest, now: float) -> None:
        self._busy = False

    def next_arrival(self) -> float | None:
        pending = bool(self._first) or not self._released
        return 0.0 if pending and not self._busy else None


class TreeLooks:
    """Counts, per admission round and request, the tree's ``peek_tiers`` and ``match_prefix``
    calls made while the engine admits (the tree's own re-matches at commit are not these)."""

    def __init__(self, engine: Any, tree: HiRadixCache) -> None:
        self.round = 0
        self.calls: Counter[tuple[str, int, str]] = Counter()  # (method, round, rid)
        self.admitted: list[tuple[int, str]] = []
        self._rids: dict[int, str] = {}
        admit = engine._admit

        def counted_admit(waiting: list[ServeRequest], running: list[ServeRequest]) -> None:
            self.round += 1
            self._rids = {id(r.key): r.rid for r in waiting}
            try:
                admit(waiting, running)
            finally:
                self._rids = {}

        engine._admit = counted_admit
        for name in ("peek_tiers", "match_prefix"):
            setattr(tree, name, self._spy(name, getattr(tree, name)))
        engine.observe(lambda e: self.admitted.append((self.round, e.request.rid)), RequestAdmitted)

    def _spy(self, name: str, method: Any) -> Any:
        def spy(key: RadixKey, *args: Any, **kwargs: Any) -> Any:
            rid = self._rids.get(id(key))
            if rid is not None:
                self.calls[(name, self.round, rid)] += 1
            return method(key, *args, **kwargs)

        return spy


def _prompts(seed: int, *lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("with_l3", [False, True], ids=["device+host", "device+host+l3"])
async def test_lpm_admits_the_longer_host_hit_first_matching_each_request_once(
    with_l3: bool, tmp_path: pathlib.Path
) -> None:
    """With L3 on, each admitting request is also asked whether it reads back from L3: that
    decision uses the round's peek, so the counts are the same."""
    # A 64-token document, then two fillers that push it out of the 128-token device (to
    # host: write-through), then a short one that stays on the device. Then a question on each
    # document at once; one request runs at a time.
    long_doc, filler1, filler2, short_doc, q1, q2 = _prompts(5, 64, 56, 56, 12, 5, 5)
    source = Phased([long_doc, filler1, filler2, short_doc], [short_doc + q1, long_doc + q2])
    mode = CacheMode.DEVICE_HOST_L3 if with_l3 else CacheMode.DEVICE_HOST
    config = hicache_config(tmp_path / "l3" if with_l3 else None)
    # Each question is under a page past its document: no read starts (L3 lacks it anyway),
    # so the order depends on the peeks alone, not on when an empty read would end.
    prefetch = dataclasses.replace(config.prefetch, threshold_tokens=4 * PAGE)
    config = dataclasses.replace(config, prefetch=prefetch)
    setup = await open_engine(tiny_model(ModelPreset.DENSE), mode, config, 128, ONE_AT_A_TIME)
    tree = setup.engine.tree
    assert isinstance(tree, HiRadixCache) and tree.storage.enabled is with_l3
    looks = TreeLooks(setup.engine, tree)
    try:
        records = await setup.engine.run(source)
    finally:
        await setup.close()
    assert all(r.error is None for r in records)
    on_short, on_long = source.together
    first_round = min(rnd for (_, rnd, rid) in looks.calls if rid == on_long.rid)
    # What the plan peeked is on the request: the long document on host, the short on device.
    assert on_long.prefix_match is not None and on_short.prefix_match is not None
    admitted = [rid for _, rid in looks.admitted]
    assert admitted.index(on_long.rid) < admitted.index(on_short.rid)
    assert on_long.record.hit_host >= 60 and on_long.record.hit_device == 0
    assert on_short.record.hit_device >= 12 and on_short.record.hit_host == 0
    # Each waiting request was peeked once a round and matched once: in its admitting round.
    rounds = {rid: [rnd for (m, rnd, r) in looks.calls if r == rid and m == "peek_tiers"]
              for rid in (on_short.rid, on_long.rid)}  # fmt: skip
    assert all(n == 1 for (m, _, _), n in looks.calls.items() if m == "peek_tiers")
    assert first_round in rounds[on_long.rid] and first_round in rounds[on_short.rid]
    matches = {(rnd, rid) for (m, rnd, rid), n in looks.calls.items() if m == "match_prefix"}
    assert all(n == 1 for (m, _, _), n in looks.calls.items() if m == "match_prefix")
    assert matches == set(looks.admitted)  # none for a request not admitted that round


def test_the_host_hit_weight_flag_reaches_the_engine_and_the_router(tmp_path: Any) -> None:
    argv = ["serve", "--host-hit-weight", "0.25", "--device-tokens", "256", "--page-size", "4",
            "--cache-dir", str(tmp_path)]  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    assert engine_config_of(args, None).host_hit_weight == 0.25
    router = router_config_of(args, serve_hicache(args))
    assert router.host_hit_weight == 0.25 and router.device_tree_tokens == 256
    assert router.max_tree_tokens == 256 * 3  # the host tier: twice the device by default


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "inf", "high"])
def test_a_host_hit_weight_outside_0_1_is_a_one_line_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "serve", "--host-hit-weight", value)
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("hicache serve: error: ") and "--host-hit-weight" in lines[-1]
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), err
