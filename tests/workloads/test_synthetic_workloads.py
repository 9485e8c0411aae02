"""Request sources: closed-loop chat turns, round barriers, shared-prefix traces, arrivals."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hicache.errors import InvalidArgumentError
from hicache.serving.request import ServeRequest
from hicache.tools.cli import main
from hicache.workloads.arrivals import TraceReplay
from hicache.workloads.synthetic import (
    ChatConfig,
    MultiTurnChat,
    SharedPrefixConfig,
    TenantSpread,
    multiturn_trace,
    shared_prefix_trace,
)


def answer(request: ServeRequest, tokens: list[int]) -> None:
    request.generated = list(tokens)


def test_next_turn_carries_the_answer_and_waits_for_the_round() -> None:
    chat = MultiTurnChat(ChatConfig(clients=2, rounds=2, system_tokens=8, turn_tokens=4,
                                    output_tokens=2, vocab=100))  # fmt: skip
    first = chat.due(0.0)
    assert [r.rid for r in first] == ["c0-r0", "c1-r0"]
    assert first[0].prompt[:8] != first[1].prompt[:8]  # two system prompts, one per client here
    answer(first[0], [7, 7])
    chat.finished(first[0], 1.0)
    assert chat.due(5.0) == []  # the barrier: client 1 has not been answered yet
    answer(first[1], [9, 9])
    chat.finished(first[1], 2.0)
    second = chat.due(2.0)
    assert [r.rid for r in second] == ["c0-r1", "c1-r1"]
    assert all(r.arrival_s == 2.0 for r in second)
    assert second[0].prompt[: len(first[0].prompt) + 2] == [*first[0].prompt, 7, 7]
    assert len(second[0].prompt) == len(first[0].prompt) + 2 + 4


def test_a_clients_turns_do_not_depend_on_who_finishes_first() -> None:
    config = ChatConfig(
        clients=3, rounds=2, system_tokens=4, turn_tokens=4, vocab=50, barrier=False
    )
    a, b = MultiTurnChat(config), MultiTurnChat(config)
    ra, rb = a.due(0.0), b.due(0.0)
    for r in ra:
        answer(r, [1])
    for r in rb:
        answer(r, [1])
    for r in ra:  # in order
        a.finished(r, 1.0)
    for r in reversed(rb):  # the other way round
        b.finished(r, 1.0)
    next_a = {r.rid: r.prompt for r in a.due(1.0)}
    next_b = {r.rid: r.prompt for r in b.due(1.0)}
    assert next_a == next_b and len(next_a) == 3


def test_a_failed_turn_ends_its_chat_and_still_releases_the_round() -> None:
    chat = MultiTurnChat(ChatConfig(clients=2, rounds=3, system_tokens=4, turn_tokens=2, vocab=9))
    first = chat.due(0.0)
    chat.finished(first[0], 1.0)  # failed: nothing generated
    answer(first[1], [3])
    chat.finished(first[1], 1.0)
    assert [r.rid for r in chat.due(1.0)] == ["c1-r1"]


def test_the_trace_and_the_closed_loop_build_the_same_chat() -> None:
    config = ChatConfig(clients=3, rounds=2, system_tokens=8, turn_tokens=(2, 5),
                        output_tokens=3, tenants=2, vocab=50)  # fmt: skip
    trace = multiturn_trace(config)
    opening = MultiTurnChat(config).due(0.0)
    assert [r.rid for r in opening] == [r.id for r in trace[:3]] == ["c0-r0", "c1-r0", "c2-r0"]
    # One prompt builder: the same system prompt per client and the same tenants. The user
    # turns differ: the trace draws from one stream, each closed-loop client from its own.
    for live, recorded in zip(opening, trace, strict=False):
        assert live.prompt[:8] == recorded.tokens[:8]
        assert live.namespace == recorded.namespace
    assert opening[0].prompt[:8] == opening[2].prompt[:8] != opening[1].prompt[:8]
    assert [r.namespace for r in opening] == ["tenant-0", "tenant-1", "tenant-0"]


def test_token_counts_are_fixed_or_drawn_from_a_range() -> None:
    config = ChatConfig(clients=4, rounds=3, system_tokens=0, turn_tokens=(1, 4),
                        output_tokens=(2, 3), vocab=10)  # fmt: skip
    trace = multiturn_trace(config)
    assert all(1 <= len(r.tokens) <= 4 for r in trace[:4])
    assert all(2 <= len(r.output_tokens) <= 3 for r in trace)
    for prev, nxt in zip(trace, trace[4:], strict=False):  # the same client, one round later
        history = prev.tokens + prev.output_tokens
        assert nxt.tokens[: len(history)] == history
        assert 1 <= len(nxt.tokens) - len(history) <= 4
    assert {r.max_new_tokens for r in MultiTurnChat(config).due(0.0)} <= {2, 3}
    assert {len(r.tokens) for r in trace} != {len(trace[0].tokens)}  # the range was drawn


@pytest.mark.parametrize("bad", [0, (0, 3), (4, 2), (1, 2, 3), (1.0, 2), True, "4"])
def test_a_token_count_must_be_a_positive_int_or_range(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="turn_tokens"):
        ChatConfig(turn_tokens=bad)


def test_chat_config_refuses_bad_sizes() -> None:
    for field in ("clients", "rounds", "system_prompts", "tenants", "vocab"):
        with pytest.raises(InvalidArgumentError, match=field):
            ChatConfig(**{field: 0})
    with pytest.raises(InvalidArgumentError, match="rate"):
        ChatConfig(rate=-1.0)
    with pytest.raises(InvalidArgumentError, match="vocab"):
        ChatConfig(vocab=2**32 + 1)


def test_shared_prefix_trace_is_deterministic_and_shares_prefixes() -> None:
    config = SharedPrefixConfig(requests=40, prefixes=3, prefix_tokens=32, question_tokens=5,
                                output_tokens=2, tenants=2, vocab=1000)  # fmt: skip
    trace = shared_prefix_trace(config)
    assert trace == shared_prefix_trace(config)
    heads = {tuple(r.tokens[:32]) for r in trace}
    assert len(heads) == 3 and all(len(r.tokens) == 37 for r in trace)
    assert {r.namespace for r in trace} == {"tenant-0", "tenant-1"}
    # The same prefix always lands in the same tenant, so the tenants' caches stay apart.
    tenant_of = {}
    for r in trace:
        assert tenant_of.setdefault(tuple(r.tokens[:32]), r.namespace) == r.namespace
    with pytest.raises(InvalidArgumentError):
        SharedPrefixConfig(prefixes=0)


def test_shared_prefixes_spread_per_request_reach_every_tenant() -> None:
    config = SharedPrefixConfig(requests=60, prefixes=2, prefix_tokens=8, question_tokens=2,
                                tenants=3, spread=TenantSpread.PER_REQUEST, vocab=100)  # fmt: skip
    tenants_of: dict[tuple[int, ...], set[str]] = {}
    for r in shared_prefix_trace(config):
        tenants_of.setdefault(tuple(r.tokens[:8]), set()).add(r.namespace)
    # Each tenant caches its own copy of a prefix, unlike BY_PREFIX (see the test above).
    assert len(tenants_of) == 2
    assert all(t == {"tenant-0", "tenant-1", "tenant-2"} for t in tenants_of.values())
    one = shared_prefix_trace(SharedPrefixConfig(requests=3, prefix_tokens=2, question_tokens=1))
    assert {r.namespace for r in one} == {""}  # one tenant: the default namespace


def test_trace_replay_arrives_by_poisson_times() -> None:
    trace = shared_prefix_trace(SharedPrefixConfig(requests=20, prefix_tokens=4, vocab=10))
    replay = TraceReplay(trace, rate=10.0, seed=1)
    times = []
    while (t := replay.next_arrival()) is not None:
        got = replay.due(t)
        times.extend(r.arrival_s for r in got)
    assert len(times) == 20 and times == sorted(times) and times[0] > 0
    assert 0.5 < times[-1] < 6.0  # 20 arrivals at 10/s


@pytest.mark.parametrize("workload", ["fewshot", "longdoc"])
def test_serve_shared_prefix_workloads(
    workload: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--vocab", "256", "--page-size", "4", "--device-tokens", "512",
            "--clients", "8", "--rounds", "2", "--system-tokens", "24", "--turn-tokens", "8",
            "--device", "cpu"]  # fmt: skip
    code = main(["serve", *tiny, "--workload", workload, "--cache-dir", str(tmp_path),
                 "--json", "-q", "--compare"])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["outputs_identical"] is True
    rows = {c["name"]: c for c in result["configs"]}
    assert rows["device"]["hit_rate"] > 0.3 and rows["none"]["hit_rate"] == 0
    assert all(c["requests"] == 16 for c in result["configs"])
