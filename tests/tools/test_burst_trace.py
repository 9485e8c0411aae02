"""The burst replay trace: long conversations, every turn present, written as JSONL."""

from __future__ import annotations

import pathlib

import pytest

from hicache.tools.burst_trace import main
from hicache.workloads.synthetic import BURST_CHAT, burst_conversations_trace
from hicache.workloads.traces import load_trace


def test_the_preset_is_long_conversations_whose_turns_extend_each_other() -> None:
    requests = burst_conversations_trace()
    assert len(requests) == BURST_CHAT.clients * BURST_CHAT.rounds
    lengths = [len(r.tokens) for r in requests]
    assert min(lengths) >= 2000 and max(lengths) <= 8192, (min(lengths), max(lengths))
    by_id = {r.id: r for r in requests}
    for r in requests:
        client, round_ = r.id.split("-r")
        if round_ != "0":
            before = by_id[f"{client}-r{int(round_) - 1}"]
            history = before.tokens + before.output_tokens
            assert r.tokens[: len(history)] == history, r.id
    assert burst_conversations_trace() == requests  # seeded


def test_the_script_writes_a_trace_that_reads_back(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "burst.jsonl"
    assert main([str(out), "--conversations", "3", "--turns", "2", "--vocab", "1000"]) == 0
    got = load_trace(out)
    assert [r.id for r in got] == ["c0-r0", "c1-r0", "c2-r0", "c0-r1", "c1-r1", "c2-r1"]
    assert all(0 <= t < 1000 for r in got for t in r.tokens)


def test_the_script_refuses_bad_flags(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.jsonl"), "--turns", "0"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "no-such-dir" / "x.jsonl")])
