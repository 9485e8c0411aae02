"""The run summary and the oracle hit rate, on hand-made inputs with hand-computed answers."""

from __future__ import annotations

import pytest

from hicache.serving.request import RequestRecord
from hicache.workloads.report import oracle_hit_rate, summarize


def test_oracle_hit_rate_by_hand() -> None:
    p1 = list(range(1, 10))  # 9 tokens
    p2 = [*p1, 100, 101, 102, 103, 104, 105, 106]  # 16 tokens, continues p1 and its answer
    sequence = [
        # empty cache: no hit; caches p1 + [100] (the last output token has no KV): 2 pages
        (None, p1, [100, 101]),
        # its first 15 tokens match p1's 2 cached pages; the 3rd page (9, 100, 101, 102) was
        # never complete: hit 8; caches all 4 pages of p2
        (None, p2, [7]),
        # another namespace shares nothing: hit 0
        ("tenant-b", p2, [1]),
        # p2 again: its reusable 15 tokens hold 3 whole pages: hit 12
        (None, list(p2), [1]),
        # a single token has nothing reusable: hit 0
        (None, [5], [1]),
    ]
    total = 9 + 16 + 16 + 16 + 1
    assert oracle_hit_rate(sequence, page=4) == round(20 / total, 4) == 0.3448
    # With one-token pages, every reusable token of a repeat hits.
    assert oracle_hit_rate([(None, [1, 2, 3], [9]), (None, [1, 2, 3], [9])], page=1) == round(
        2 / 6, 4
    )
    assert oracle_hit_rate([], page=4) == 0.0


def test_summarize_by_hand() -> None:
    records = []
    for i, (ttft, device, host, l3) in enumerate([(0.010, 8, 0, 0), (0.030, 0, 4, 4)]):
        r = RequestRecord(f"r{i}", arrival_s=1.0, prompt_tokens=20)
        r.first_token_s, r.output_tokens = 1.0 + ttft, 5
        r.hit_device, r.hit_host, r.hit_l3 = device, host, l3
        records.append(r)
    failed = RequestRecord("bad", arrival_s=0.0, prompt_tokens=0, error="empty prompt")
    row = summarize("x", [*records, failed], wall_s=2.0, metrics={"timeouts": 1, "errors": 2})
    assert row["requests"] == 2 and row["failed"] == 1
    assert row["ttft_p50_ms"] == pytest.approx(20.0) and row["ttft_mean_ms"] == pytest.approx(20.0)
    assert row["ttft_p90_ms"] == pytest.approx(28.0)
    assert (row["hit_tokens_device"], row["hit_tokens_host"], row["hit_tokens_l3"]) == (8, 4, 4)
    assert row["prompt_tokens"] == 40 and row["hit_rate"] == 0.4
    assert row["throughput_tok_s"] == (40 + 10) / 2.0
    assert row["errors"] == 3
    empty = summarize("none", [], wall_s=0.0, metrics={})
    # No request succeeded: no TTFT figures (None, which JSON writes as null; never NaN).
    assert empty["ttft_p50_ms"] is None and empty["ttft_mean_ms"] is None
    assert empty["hit_rate"] == 0.0 and empty["requests"] == 0
