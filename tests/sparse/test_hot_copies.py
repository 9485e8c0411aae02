"""HiSparse's copies driven by the fused step's result, beside the forward.

The copy thread runs jobs in order, really concurrently with the consumer, hands a job's error
to the consumer and to every later launch, and stops cleanly; served tokens and logits are the
same with overlapped copies (the CPU copy thread, and the CUDA path's masked copies computed on
the CPU) as with synchronous ones; on CUDA the side stream gives the same tokens again.
"""

from __future__ import annotations

import threading

import pytest
import torch
from cuda_kit import needs_cuda
from model_kit import VOCAB, model_config, tiny_model

from hicache.models.config import ModelPreset
from hicache.models.tiny import TinyTransformer
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.engine_events import TokenSampled
from hicache.serving.request import ServeRequest
from hicache.serving.setup import ServingSetup, open_engine
from hicache.sparse.hot_buffer import HiSparseConfig
from hicache.sparse.hot_copies import CopyMode, HotCopyError, InlineCopies, ThreadCopies
from hicache.tiering.common.config import HiCacheConfig, TierConfig
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.traces import TraceRequest

DSA = ModelPreset.DSA
TOPK = model_config(DSA).index_topk_pages


# ----- the copy thread ---------------------------------------------------------------------------
def test_jobs_run_in_order_beside_the_consumer_on_a_named_thread() -> None:
    copies = ThreadCopies()
    release = threading.Event()
    ran: list[tuple[int, str]] = []

    def job(i: int) -> None:
        if i == 0:
            assert release.wait(10), "the consumer never ran while the copy was pending"
        ran.append((i, threading.current_thread().name))

    pending = [copies.launch(lambda i=i: job(i)) for i in range(5)]
    assert ran == []  # launch returned while the first job still waits for the consumer
    release.set()
    pending[-1].wait()
    assert [i for i, _ in ran] == list(range(5))
    assert {name for _, name in ran} == {"hisparse-copies"}
    assert copies.times.jobs == 5 and copies.times.copy_s > 0
    copies.close()
    assert not any(t.name == "hisparse-copies" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(HotCopyError, match="closed"):
        copies.launch(lambda: None)


def test_a_failed_copy_is_raised_in_the_consumer_and_by_later_launches() -> None:
    copies = ThreadCopies()

    def broken() -> None:
        raise IndexError("page 7 out of range")

    ok = copies.launch(lambda: None)
    bad = copies.launch(broken)
    ok.wait()
    with pytest.raises(HotCopyError, match="page 7"):
        bad.wait()
    with pytest.raises(HotCopyError, match="earlier HiSparse copy failed"):
        copies.launch(lambda: None)
    copies.close()


def test_an_idle_worker_ends_and_the_next_launch_starts_another() -> None:
    copies = ThreadCopies(name="hisparse-copies-idle")
    copies.launch(lambda: None).wait()
    worker = copies._worker
    assert worker is not None
    worker.join(10)  # ends on its own after an idle second
    assert not worker.is_alive()
    done: list[int] = []
    copies.launch(lambda: done.append(1)).wait()
    assert done == [1]
    copies.close()


def test_inline_copies_count_every_second_as_waited() -> None:
    copies = InlineCopies()
    copies.launch(lambda: sum(range(10_000))).wait()
    assert copies.times.jobs == 1 and copies.times.copy_s > 0
    assert copies.times.waited_s == copies.times.copy_s and copies.times.hidden == 0.0


# ----- served tokens -----------------------------------------------------------------------------
def _requests() -> TraceReplay:
    """Five prompts of 9 to 40 tokens, each generating past several pages, all at once."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(9, 12), (23, 9), (40, 14), (17, 11), (31, 7)]
    return TraceReplay(
        [
            TraceRequest(
                f"r{i}", "", torch.randint(0, VOCAB, (n,), generator=gen).tolist(), [0] * m
            )
            for i, (n, m) in enumerate(shapes)
        ]
    )


class _Outputs:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[tuple[str, int], torch.Tensor] = {}

    def watch(self, setup: ServingSetup) -> None:
        def record(sampled: TokenSampled) -> None:
            self.logits[(sampled.request.rid, sampled.position)] = sampled.logits.cpu()

        setup.engine.observe(record, TokenSampled)


async def _serve(
    model: TinyTransformer, mode: CopyMode, masked: bool = False
) -> tuple[_Outputs, ServingSetup]:
    outputs = _Outputs()
    engine = EngineConfig(
        max_running=3, stall_s=20.0, hisparse=HiSparseConfig(hot_pages=TOPK, copy_mode=mode)
    )
    config = HiCacheConfig(tiers=TierConfig(host_pages=96))
    setup = await open_engine(model, CacheMode.DEVICE_HOST, config, 128, engine)
    assert setup.engine.sparse is not None
    setup.engine.sparse.buffer.masked_copies = masked or setup.engine.sparse.buffer.masked_copies
    outputs.watch(setup)
    source = _requests()

    def finished(request: ServeRequest, now: float) -> None:
        assert request.record.error is None, request.record.error
        outputs.tokens[request.rid] = list(request.generated)

    source.finished = finished  # type: ignore[method-assign]
    try:
        await setup.engine.run(source)
    finally:
        await setup.close()
    return outputs, setup


def _assert_same(got: _Outputs, want: _Outputs, label: str) -> None:
    assert got.tokens == want.tokens and len(want.tokens) == 5, label
    assert got.logits.keys() == want.logits.keys(), label
    for key, logits in want.logits.items():
        assert torch.equal(got.logits[key], logits), (label, key)


@pytest.mark.parametrize("masked", [False, True], ids=["listed", "masked"])
async def test_overlapped_copies_give_the_synchronous_tokens(masked: bool) -> None:
    """The copy thread (with the misses listed, as on the CPU, or masked, as the CUDA path
    computes them from the step's result) against the synchronous copies: the same tokens
    and logits, bit for bit, with the buffer as small as the top-k (misses every step)."""
    model = tiny_model(DSA)
    want, sync = await _serve(model, CopyMode.SYNC)
    got, overlap = await _serve(model, CopyMode.OVERLAP, masked)
    _assert_same(got, want, "overlap")
    assert sync.engine.sparse is not None and overlap.engine.sparse is not None
    sync_buffer, overlap_buffer = sync.engine.sparse.buffer, overlap.engine.sparse.buffer
    assert isinstance(sync_buffer.copies, InlineCopies)
    assert isinstance(overlap_buffer.copies, ThreadCopies)
    assert overlap_buffer.stats == sync_buffer.stats and sync_buffer.stats.missed_pages > 0
    times, sync_times = overlap_buffer.copy_times, sync_buffer.copy_times
    layers = model.config.layers
    assert times.jobs == sync_times.jobs > 0 and times.jobs % layers == 0  # a job per layer
    assert times.copy_s > 0 and times.hidden is not None and sync_times.hidden == 0.0


@pytest.mark.cuda
@needs_cuda
async def test_side_stream_copies_give_the_synchronous_tokens_on_cuda() -> None:
    """On CUDA: copies queued on a side stream from the step's result tensors, against the
    synchronous path on the same device."""
    from hicache.sparse.hot_copies import StreamCopies

    model = TinyTransformer(model_config(DSA), torch.device("cuda"))
    want, _ = await _serve(model, CopyMode.SYNC)
    got, overlap = await _serve(model, CopyMode.OVERLAP)
    _assert_same(got, want, "side stream")
    assert overlap.engine.sparse is not None
    buffer = overlap.engine.sparse.buffer
    assert isinstance(buffer.copies, StreamCopies) and buffer.masked_copies
    assert buffer.stats.missed_pages > 0 and buffer.copy_times.copy_s > 0
