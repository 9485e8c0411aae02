"""Shared pieces of the serving tests: tiny models, small workloads, and one call that serves.

Sizes are chosen so every tier is used on a 2-core CPU in well under a second per run: the chat's
working set (8 clients x 3 rounds, ~740 tokens) is about 6 times the device pool (128 tokens) and
twice the host tier (96 pages of 4 tokens), so pages move from the device to host and from host
to L3; a restart over the same L3 reads them back. With every round released at once, which tier
a chat request's pages come from depends on timing, so the tests that need a first-run L3 hit use
the one-request-at-a-time ``Sequential`` workload, where it depends on sizes only.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

# The model's pieces are the model tests' (tests/model_kit.py); the serving tests import them here.
from model_kit import PAGE, VOCAB, model_config, relative_error, tiny_model  # noqa: F401

from hicache.keys import StorageFormat
from hicache.models.config import ModelPreset
from hicache.models.types import ServingModel
from hicache.serving.engine import CacheMode, EngineConfig, RequestSource
from hicache.serving.engine_events import TokenSampled
from hicache.serving.request import RequestRecord, ServeRequest
from hicache.serving.setup import ServingSetup, open_engine
from hicache.tiering.common.config import HiCacheConfig, PrefetchConfig, StorageConfig, TierConfig
from hicache.tiering.common.policies import PrefetchStopPolicy, WritePolicy
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.synthetic import ChatConfig, MultiTurnChat
from hicache.workloads.traces import TraceRequest

DEVICE_TOKENS = 128
HOST_PAGES = 96
CHAT = ChatConfig(
    clients=8,
    rounds=3,
    system_tokens=32,
    system_prompts=2,
    turn_tokens=16,
    output_tokens=4,
    vocab=VOCAB,
)
RUN_TIMEOUT_S = 60.0
# dsv4 needs pages of 128 tokens (its 128:1 groups), far past these sizes: its own tests, with
# its own model and workloads, are in test_serving_dsv4.py.
ALL_PRESETS = [p for p in ModelPreset if p is not ModelPreset.DSV4]
# Prefetch whatever L3 holds, however slow it looks: on a tiny model compute is so fast that
# the engine's "is reading worth it" estimate would otherwise skip prefetches at random.
# A request that cannot be admitted fails after stall_s, so a stall shows up as an error record.
ENGINE = EngineConfig(max_running=2, skip_slow_prefetch=False, stall_s=20.0)


def hicache_config(
    l3_dir: pathlib.Path | None,
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    stop_policy: PrefetchStopPolicy = PrefetchStopPolicy.TIMEOUT,
    host_pages: int = HOST_PAGES,
) -> HiCacheConfig:
    """A small host tier and a file L3 in ``l3_dir`` (none when ``l3_dir`` is None)."""
    return HiCacheConfig(
        tiers=TierConfig(write_policy=write_policy, write_threshold=1, host_pages=host_pages),
        prefetch=PrefetchConfig(stop_policy=stop_policy, threshold_tokens=PAGE),
        storage=StorageConfig(url=None if l3_dir is None else f"file://{l3_dir}"),
    )


class Recording:
    """A request source that keeps what every finished request generated (and its prompt)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.outputs: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}

    def due(self, now: float) -> list[ServeRequest]:
        due: list[ServeRequest] = self.inner.due(now)
        return due

    def finished(self, request: ServeRequest, now: float) -> None:
        if request.record.error is None:
            self.outputs[request.rid] = list(request.generated)
            self.prompts[request.rid] = list(request.prompt)
        self.inner.finished(request, now)

    def next_arrival(self) -> float | None:
        arrival: float | None = self.inner.next_arrival()
        return arrival


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    records: list[RequestRecord]
    metrics: dict[str, float]
    prompts: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    formats: dict[str, StorageFormat] = field(default_factory=dict)  # L3 key format, per pool

    def hits(self, tier: str) -> int:
        """Hit tokens of successful requests on ``tier`` (device, host or l3)."""
        return sum(getattr(r, f"hit_{tier}") for r in self.records if r.error is None)

    @property
    def computed(self) -> int:
        return sum(r.computed_tokens for r in self.records)

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.records if r.error is not None]


def _capture_logits(setup: ServingSetup, into: dict[tuple[str, int], torch.Tensor]) -> None:
    """Keep the logits every token was sampled from, by (request, output position)."""

    def record(sampled: TokenSampled) -> None:
        into[(sampled.request.rid, sampled.position)] = sampled.logits.clone()

    setup.engine.observe(record, TokenSampled)


async def serve(
    preset: ModelPreset,
    mode: CacheMode,
    source: RequestSource | None = None,
    config: HiCacheConfig | None = None,
    device_tokens: int = DEVICE_TOKENS,
    engine: EngineConfig = ENGINE,
    logits: bool = False,
    model: ServingModel | None = None,
    watch: Callable[[ServingSetup], None] | None = None,
) -> RunResult:
    """Serve ``source`` (the small chat by default) with a fresh engine, then close it.
    ``model`` replaces the preset's tiny model; ``watch`` sees the setup before the run."""
    config = config or hicache_config(None)
    recording = Recording(source if source is not None else MultiTurnChat(CHAT))
    setup = await open_engine(model or tiny_model(preset), mode, config, device_tokens, engine)
    captured: dict[tuple[str, int], torch.Tensor] = {}
    if logits:
        _capture_logits(setup, captured)
    if watch is not None:
        watch(setup)
    try:
        # A run that stops making progress would spin forever: fail it instead.
        records = await asyncio.wait_for(setup.engine.run(recording), RUN_TIMEOUT_S)
    finally:
        await setup.close()
    cache = setup.cache
    metrics = cache.metrics.as_dict() if cache is not None else {}
    formats = dict(cache.page_formats) if cache is not None else {}
    return RunResult(recording.outputs, records, metrics, recording.prompts, captured, formats)


class Sequential:
    """Closed loop with one request in flight: the next prompt arrives when the last finished.

    Which tier serves a revisited prompt then depends on sizes only, not on timing.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], output_tokens: int = 3) -> None:
        self._pending = deque(
            ServeRequest(f"s{i}", list(p), output_tokens) for i, p in enumerate(prompts)
        )
        self._busy = False

    def due(self, now: float) -> list[ServeRequest]:
        if self._busy or not self._pending:
            return []
        self._busy = True
        request = self._pending.popleft()
        request.arrival_s = request.record.arrival_s = now
        return [request]

    def finished(self, request: ServeRequest, now: float) -> None:
        self._busy = False

    def next_arrival(self) -> float | None:
        return 0.0 if self._pending and not self._busy else None


def revisit_prompts(docs: int = 10, doc_tokens: int = 44, revisits: int = 3) -> list[list[int]]:
    """``docs`` distinct prompts (more than the host tier holds), then the first ``revisits``
    of them again with a new question: their prefix is then in L3 only."""
    gen = torch.Generator().manual_seed(7)
    bodies = [torch.randint(0, VOCAB, (doc_tokens,), generator=gen).tolist() for _ in range(docs)]
    questions = [torch.randint(0, VOCAB, (5,), generator=gen).tolist() for _ in range(revisits)]
    return bodies + [bodies[i] + questions[i] for i in range(revisits)]


def trace(prompts: Sequence[Sequence[int]], output_tokens: int = 3) -> TraceReplay:
    """Prompts all arriving at once, each generating ``output_tokens`` tokens."""
    requests = [
        TraceRequest(f"t{i}", "", list(p), [0] * output_tokens) for i, p in enumerate(prompts)
    ]
    return TraceReplay(requests)


def workload(name: str) -> RequestSource:
    """A fresh source of a named workload: ``chat`` or ``revisit``."""
    if name == "chat":
        return MultiTurnChat(CHAT)
    if name == "revisit":
        return Sequential(revisit_prompts())
    raise ValueError(f"no workload {name!r}")


_BASELINES: dict[tuple[ModelPreset, str], RunResult] = {}


async def baseline(preset: ModelPreset, name: str = "chat") -> RunResult:
    """The no-cache run of a workload (with logits), computed once per test session."""
    key = (preset, name)
    if key not in _BASELINES:
        _BASELINES[key] = await serve(preset, CacheMode.NONE, workload(name), logits=True)
    return _BASELINES[key]


def assert_same_run(got: RunResult, want: RunResult, label: str) -> None:
    """Same requests finished, token for token, and each token's logits within 1e-4."""
    assert not got.errors, f"{label}: {got.errors}"
    assert got.outputs == want.outputs, f"{label}: outputs differ from the no-cache run"
    assert got.prompts == want.prompts, f"{label}: the workload sent different prompts"
    if got.logits:
        assert got.logits.keys() == want.logits.keys()
        worst = max(relative_error(got.logits[k], want.logits[k]) for k in want.logits)
        assert worst <= 1e-4, f"{label}: logits differ by {worst:.2e} (relative)"


def keep_setups(monkeypatch: pytest.MonkeyPatch) -> list[ServingSetup]:
    """The engines ``hicache serve`` opens in this test, in order (it is run in-process)."""
    from hicache.tools.serve import command as serve_module

    setups: list[ServingSetup] = []
    opened = serve_module.open_engine

    async def keep(*args: Any, **kwargs: Any) -> ServingSetup:
        setups.append(await opened(*args, **kwargs))
        return setups[-1]

    monkeypatch.setattr(serve_module, "open_engine", keep)
    return setups
