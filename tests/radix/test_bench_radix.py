"""``hicache bench radix``: exact hit counts against brute force, traces on disk, bad lines."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from hicache.errors import InvalidArgumentError, TraceFormatError
from hicache.radix import EvictionPolicy
from hicache.tools.bench.cache.radix import (
    RadixBenchConfig,
    add_bench_radix_parser,
    bench_trace,
    run_bench_radix,
)
from hicache.workloads.synthetic import (
    ChatConfig,
    SharedPrefixConfig,
    TenantSpread,
    WorkloadConfig,
    WorkloadKind,
    generate_trace,
    multiturn_trace,
    shared_prefix_trace,
)
from hicache.workloads.traces import (
    TraceRequest,
    dump_trace,
    format_trace,
    load_trace,
    parse_trace,
)

REQUIRED_KEYS = [
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "hit_rate",
    "evicted_tokens",
    "final_cached_tokens",
    "seconds",
    "us_per_request",
]
SMALL = {
    WorkloadKind.MULTITURN: WorkloadConfig(WorkloadKind.MULTITURN, clients=8, rounds=3),
    WorkloadKind.FEWSHOT: WorkloadConfig(WorkloadKind.FEWSHOT, clients=32, rounds=1),
    WorkloadKind.LONGDOC: WorkloadConfig(WorkloadKind.LONGDOC, clients=16, rounds=1),
}


def brute_force_hits(requests: Sequence[TraceRequest], page_size: int) -> int:
    """Sum over requests of the longest page-aligned prefix the prompt shares with any earlier
    request's prompt + output in the same namespace (no tree involved)."""
    earlier: dict[str, list[np.ndarray]] = {}
    total = 0
    for req in requests:
        prompt = np.array(req.tokens, dtype=np.int64)
        best = 0
        for seq in earlier.get(req.namespace, []):
            n = min(len(prompt), len(seq))
            differ = np.flatnonzero(prompt[:n] != seq[:n])
            shared = int(differ[0]) if differ.size else n
            best = max(best, shared - shared % page_size)
        total += best
        full = np.array(req.tokens + req.output_tokens, dtype=np.int64)
        earlier.setdefault(req.namespace, []).append(full)
    return total


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_radix_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["radix", "--repeats", "1", *argv])


@pytest.fixture(scope="module")
def traces() -> dict[WorkloadKind, list[TraceRequest]]:
    return {kind: generate_trace(config) for kind, config in SMALL.items()}


# ----- exact hit counts -----------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_unbounded_hits_equal_brute_force(
    traces: dict[WorkloadKind, list[TraceRequest]], kind: WorkloadKind, page_size: int
) -> None:
    requests = traces[kind]
    row = bench_trace(requests, RadixBenchConfig(page_size=page_size, repeats=1))
    expected = brute_force_hits(requests, page_size)
    assert expected > 0  # every workload shares prefixes; a zero would test nothing
    assert row["hit_tokens"] == expected
    assert row["evicted_tokens"] == 0
    assert list(row)[: len(REQUIRED_KEYS)] == REQUIRED_KEYS
    assert row["prompt_tokens"] == sum(len(r.tokens) for r in requests)


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_bounded_capacity_is_respected(
    traces: dict[WorkloadKind, list[TraceRequest]], policy: EvictionPolicy
) -> None:
    requests = traces[WorkloadKind.MULTITURN]
    unbounded = bench_trace(requests, RadixBenchConfig(page_size=4, repeats=1))
    capacity = unbounded["final_cached_tokens"] // 4
    config = RadixBenchConfig(page_size=4, policy=policy, capacity_tokens=capacity, repeats=1)
    row = bench_trace(requests, config)
    assert 0 < row["final_cached_tokens"] <= capacity
    assert row["evicted_tokens"] > 0
    # A smaller cache holds a subset of what the unbounded one holds, so it never hits more.
    assert row["hit_tokens"] <= unbounded["hit_tokens"]
    # What was inserted either stays or was evicted: the accounting balances.
    assert row["final_cached_tokens"] + row["evicted_tokens"] >= unbounded["final_cached_tokens"]


def test_multiturn_prompts_extend_the_previous_round() -> None:
    requests = generate_trace(WorkloadConfig(clients=3, rounds=3, namespaces=2))
    assert [r.id for r in requests[:4]] == ["c0-r0", "c1-r0", "c2-r0", "c0-r1"]
    first, second = requests[0], requests[3]
    assert second.tokens[: len(first.tokens) + len(first.output_tokens)] == (
        first.tokens + first.output_tokens
    )
    assert {r.namespace for r in requests} == {"tenant-0", "tenant-1"}
    assert all(0 <= t < 32000 for r in requests for t in r.tokens + r.output_tokens)


def test_generation_is_seeded() -> None:
    config = WorkloadConfig(WorkloadKind.FEWSHOT, clients=16, rounds=1, seed=7)
    assert generate_trace(config) == generate_trace(config)
    other = WorkloadConfig(WorkloadKind.FEWSHOT, clients=16, rounds=1, seed=8)
    assert generate_trace(config) != generate_trace(other)


def test_presets_are_the_shared_generators(
    traces: dict[WorkloadKind, list[TraceRequest]],
) -> None:
    for kind, preset in SMALL.items():
        generator = preset.generator_config()
        if kind is WorkloadKind.MULTITURN:
            assert isinstance(generator, ChatConfig)
            assert traces[kind] == multiturn_trace(generator)
        else:
            assert isinstance(generator, SharedPrefixConfig)
            assert traces[kind] == shared_prefix_trace(generator)
            assert generator.spread is TenantSpread.PER_REQUEST
    # Per-request tenants: a few-shot template is cached once per namespace that asks for it.
    namespaces_of: dict[tuple[int, ...], set[str]] = {}
    for r in traces[WorkloadKind.FEWSHOT]:
        namespaces_of.setdefault(tuple(r.tokens[:1000]), set()).add(r.namespace)
    assert len(namespaces_of) == SMALL[WorkloadKind.FEWSHOT].clients // 16
    assert any(len(n) == 2 for n in namespaces_of.values())


@pytest.mark.parametrize("field", ["clients", "rounds", "namespaces", "vocab"])
def test_workload_config_refuses_non_positive(field: str) -> None:
    with pytest.raises(InvalidArgumentError):
        WorkloadConfig(**{field: 0})  # type: ignore[arg-type]


# ----- traces on disk -------------------------------------------------------------------------
def test_trace_round_trip(tmp_path: Path, traces: dict[WorkloadKind, list[TraceRequest]]) -> None:
    requests = traces[WorkloadKind.MULTITURN]
    path = tmp_path / "trace.jsonl"
    dump_trace(requests, path)
    assert load_trace(path) == requests
    assert len(path.read_text().splitlines()) == len(requests)
    assert load_trace(io.StringIO("".join(format_trace(requests)))) == requests


def test_blank_lines_are_skipped_and_lines_counted() -> None:
    good = '{"id": "a", "namespace": "", "tokens": [1, 2], "output_tokens": []}'
    assert len(parse_trace(["", good, "   ", good])) == 2
    with pytest.raises(TraceFormatError) as err:
        parse_trace([good, "", "{"])
    assert err.value.line == 3
    assert "trace line 3" in str(err.value)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"id": "a", "namespace": "n", "tokens": [1]}', "output_tokens"),
        ('{"namespace": "n", "tokens": [1], "output_tokens": []}', "'id'"),
        ('{"id": 3, "namespace": "n", "tokens": [1], "output_tokens": []}', "'id'"),
        ('{"id": "a", "namespace": null, "tokens": [1], "output_tokens": []}', "'namespace'"),
        ('{"id": "a", "namespace": "n", "tokens": "12", "output_tokens": []}', "'tokens'"),
        ('{"id": "a", "namespace": "n", "tokens": [], "output_tokens": []}', "empty"),
        ('{"id": "a", "namespace": "n", "tokens": [-1], "output_tokens": []}', "-1"),
        (
            '{"id": "a", "namespace": "n", "tokens": [4294967296], "output_tokens": []}',
            "4294967296",
        ),
        ('{"id": "a", "namespace": "n", "tokens": [1.0], "output_tokens": []}', "1.0"),
        ('{"id": "a", "namespace": "n", "tokens": [true], "output_tokens": []}', "True"),
        ('{"id": "a", "namespace": "n", "tokens": [1], "output_tokens": ["x"]}', "'x'"),
    ],
)
def test_bad_trace_lines_name_the_line(line: str, problem: str) -> None:
    good = '{"id": "ok", "namespace": "n", "tokens": [0, 4294967295], "output_tokens": [7]}'
    with pytest.raises(TraceFormatError) as err:
        parse_trace([good, line])
    assert err.value.line == 2
    assert problem in str(err.value)
    assert isinstance(err.value, InvalidArgumentError)


# ----- the command ----------------------------------------------------------------------------
def test_command_generates_dumps_and_replays(tmp_path: Path) -> None:
    dumped = tmp_path / "multiturn.jsonl"
    args = bench_args("--clients", "4", "--rounds", "2", "--page-size", "16")
    args.dump_trace = str(dumped)
    (generated,) = run_bench_radix(args)
    (replayed,) = run_bench_radix(bench_args("--trace", str(dumped), "--page-size", "16"))
    for key in ("requests", "prompt_tokens", "hit_tokens", "final_cached_tokens"):
        assert generated[key] == replayed[key]
    assert generated["requests"] == 8 and generated["workload"] == "multiturn"
    assert replayed["trace"] == str(dumped)
    json.dumps(generated)  # --json prints the row as is


def test_command_capacity_share_is_a_share_of_unique_tokens() -> None:
    base = ["--workload", "multiturn", "--clients", "8", "--rounds", "2"]
    (unbounded,) = run_bench_radix(bench_args(*base))
    (bounded,) = run_bench_radix(bench_args(*base, "--capacity-share", "0.5", "--policy", "lfu"))
    assert bounded["capacity_tokens"] == unbounded["final_cached_tokens"] // 2
    assert bounded["final_cached_tokens"] <= bounded["capacity_tokens"]
    assert bounded["policy"] == "lfu"


def test_command_refuses_bad_input(tmp_path: Path) -> None:
    """Flags are checked when parsed (usage errors: exit 2); a trace with no request when run."""
    bad = [
        ("--trace", str(tmp_path / "missing.jsonl")),
        ("--capacity-tokens", "-1"),
        ("--capacity-share", "1.5"),
        ("--match-scaling", "1"),
    ]
    for flag, value in bad:
        with pytest.raises(SystemExit) as exit_info:
            bench_args(flag, value)
        assert exit_info.value.code == 2, flag
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InvalidArgumentError, match="no requests"):
        run_bench_radix(bench_args("--trace", str(empty)))


def test_match_scaling_compares_equal_matches() -> None:
    workload = WorkloadConfig(clients=4, rounds=2)
    (row,) = run_bench_radix(bench_args("--clients", "4", "--rounds", "2", "--match-scaling", "3"))
    assert row["sequences_1x"] == 8 and row["sequences_3x"] == 24
    assert row["nodes_3x"] > row["nodes_1x"]
    # Every probe is cached whole in both trees: as many pages as its prompt has.
    prompts = generate_trace(workload)
    assert row["matched_pages_per_probe"] == round(sum(len(r.tokens) for r in prompts) / 8, 1)
    assert row["us_per_match_1x"] > 0 and row["us_per_match_3x"] > 0
