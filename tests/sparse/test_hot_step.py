"""The HiSparse fused step: torch version against the plain-Python model, Triton against torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cuda_kit import needs_cuda
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import InvalidArgumentError
from hicache.sparse.hot_step import HotStep, hot_step, hot_step_torch, hot_step_triton, miss_list
from hicache.sparse.hot_step_triton import MAX_TRITON_SLOTS

from .hot_reference_kit import reference_step

HAS_TRITON = importlib.util.find_spec("triton") is not None
StepFn = Callable[..., HotStep]


@dataclass(frozen=True)
class Scenario:
    """A starting state and the steps run on it; ``last_used`` stays below ``first_stamp``."""

    held: list[list[int]]
    last_used: list[list[int]]
    steps: list[tuple[list[int], list[list[int]]]]
    k: int
    first_stamp: int


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    n_rows = draw(st.integers(1, 5))
    n_slots = draw(st.integers(1, 8))
    k = draw(st.integers(0, n_slots))
    # A small page universe makes pages come back across steps, which gives hits.
    pages = st.integers(0, draw(st.integers(1, 2 * n_slots + 1)))
    held = []
    for _ in range(n_rows):
        row = draw(st.lists(st.one_of(st.just(-1), pages), min_size=n_slots, max_size=n_slots))
        held.append([p if p < 0 or p not in row[:i] else -1 for i, p in enumerate(row)])
    # Stamps from a tiny range give the ties that the slot index must break.
    stamps = st.lists(st.integers(-1, 2), min_size=n_slots, max_size=n_slots)
    last_used = [draw(stamps) for _ in range(n_rows)]
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        order = draw(st.permutations(range(n_rows)))
        rows = order[: draw(st.integers(0, n_rows))]
        wanted = []
        for _ in rows:
            real = draw(st.lists(pages, unique=True, max_size=k))
            wanted.append(draw(st.permutations(real + [-1] * (k - len(real)))))
        steps.append((rows, wanted))
    return Scenario(held, last_used, steps, k, first_stamp=3)


def as_tensors(
    rows: list[int], wanted: list[list[int]], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows_t = torch.tensor(rows, dtype=torch.int64)
    wanted_t = torch.tensor(wanted, dtype=torch.int64).reshape(len(rows), k)
    return rows_t, wanted_t


def check_invariants(
    held_before: torch.Tensor,
    held: torch.Tensor,
    rows: torch.Tensor,
    wanted: torch.Tensor,
    result: HotStep,
) -> None:
    """Properties any correct step has, independent of the victim order."""
    for b, row in enumerate(rows.tolist()):
        used = [s for s in result.slots[b].tolist() if s >= 0]
        assert len(used) == len(set(used)), f"row {row} uses a slot twice: {used}"
        for page, slot in zip(wanted[b].tolist(), result.slots[b].tolist()):
            assert (slot >= 0) == (page >= 0)
            if page >= 0:
                assert int(held[row, slot]) == page
        not_held = [p for p in wanted[b].tolist() if p >= 0 and p not in held_before[row].tolist()]
        assert int(result.miss[b].sum()) == len(not_held)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_torch_matches_reference(scenario: Scenario) -> None:
    held = torch.tensor(scenario.held, dtype=torch.int64)
    last_used = torch.tensor(scenario.last_used, dtype=torch.int64)
    model_held = [list(r) for r in scenario.held]
    model_last = [list(r) for r in scenario.last_used]
    for i, (rows, wanted) in enumerate(scenario.steps):
        stamp = scenario.first_stamp + i
        rows_t, wanted_t = as_tensors(rows, wanted, scenario.k)
        held_before = held.clone()
        # Unchecked runs must compute the same; the checks only refuse.
        result = hot_step_torch(held, last_used, rows_t, wanted_t, stamp, check=i % 2 == 0)
        want_slots, want_miss = reference_step(model_held, model_last, rows, wanted, stamp)

        assert result.slots.tolist() == want_slots
        assert result.miss.tolist() == want_miss
        assert result.slots.dtype == torch.int64 and result.miss.dtype == torch.bool
        assert held.tolist() == model_held
        assert last_used.tolist() == model_last
        check_invariants(held_before, held, rows_t, wanted_t, result)


def test_miss_list_names_the_copies_row_major() -> None:
    held = torch.tensor([[5, -1, -1], [7, 8, -1]])
    last_used = torch.tensor([[0, -1, -1], [0, 0, -1]])
    rows = torch.tensor([1, 0])
    wanted = torch.tensor([[9, 7], [-1, 6]])
    result = hot_step(held, last_used, rows, wanted, 1)
    miss_rows, miss_pages, miss_slots = miss_list(rows, wanted, result)
    assert miss_rows.tolist() == [1, 0]
    assert miss_pages.tolist() == [9, 6]
    assert miss_slots.tolist() == [2, 1]
    assert miss_rows.dtype == miss_pages.dtype == miss_slots.dtype == torch.int64


# Step 2 takes the empty slot 2 over slots 0 and 1, which were used: empty slots go first.
# (wanted, expected slots, expected miss, held after, last_used after); stamps 0, 1, 2, ...
LRU_STEPS = [
    ([10, 11], [0, 1], [True, True], [10, 11, -1, -1], [0, 0, -1, -1]),
    ([12, -1], [2, -1], [True, False], [10, 11, 12, -1], [0, 0, 1, -1]),
    ([-1, 13], [-1, 3], [False, True], [10, 11, 12, 13], [0, 0, 1, 2]),
    ([10, -1], [0, -1], [False, False], [10, 11, 12, 13], [3, 0, 1, 2]),
    # Slot 1 is the least recently used, but 11 is wanted too, so 14 takes the next one.
    ([14, 11], [2, 1], [True, False], [10, 11, 14, 13], [3, 4, 4, 2]),
    ([15, 16], [3, 0], [True, True], [16, 11, 14, 15], [5, 4, 4, 5]),
    # Slots 1 and 2 tie at stamp 4: the lower index goes first.
    ([17, 18], [1, 2], [True, True], [16, 17, 18, 15], [5, 6, 6, 5]),
]


@pytest.mark.parametrize("step_fn", [hot_step, hot_step_torch])
def test_lru_order_by_hand(step_fn: StepFn) -> None:
    held = torch.full((2, 4), -1, dtype=torch.int64)
    last_used = torch.full((2, 4), -1, dtype=torch.int64)
    for stamp, (wanted, slots, miss, held_after, last_after) in enumerate(LRU_STEPS):
        result = step_fn(held, last_used, torch.tensor([1]), torch.tensor([wanted]), stamp)
        assert result.slots.tolist() == [slots]
        assert result.miss.tolist() == [miss]
        assert held[1].tolist() == held_after
        assert last_used[1].tolist() == last_after
        assert held[0].tolist() == [-1] * 4, "a row not stepped must stay untouched"


def random_case(
    n_rows: int, n_slots: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A valid random state: distinct pages per row, some empty, stamps with ties, in [-1, 3]."""
    universe = 2 * n_slots + 1
    held = torch.stack([torch.randperm(universe, generator=gen)[:n_slots] for _ in range(n_rows)])
    held[torch.rand(held.shape, generator=gen) < 0.2] = -1
    last_used = torch.randint(-1, 4, held.shape, generator=gen)
    return held, last_used


def random_step(
    n_rows: int, n_slots: int, k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct rows and, per row, ``k`` distinct pages with about a quarter padding."""
    n_step = int(torch.randint(1, n_rows + 1, (1,), generator=gen))
    rows = torch.randperm(n_rows, generator=gen)[:n_step]
    universe = 2 * n_slots + 1
    wanted = torch.stack([torch.randperm(universe, generator=gen)[:k] for _ in range(n_step)])
    wanted[torch.rand(wanted.shape, generator=gen) < 0.25] = -1
    return rows, wanted


def compare_triton_to_torch(
    device: str, sizes: list[tuple[int, int, int]], steps: int, first_stamp: int = 4
) -> None:
    """Run both versions on identical inputs; raise AssertionError on the first difference."""
    gen = torch.Generator().manual_seed(1234)
    for n_rows, n_slots, k in sizes:
        held, last_used = (t.to(device) for t in random_case(n_rows, n_slots, gen))
        held_b, last_b = held.clone(), last_used.clone()
        for stamp in range(first_stamp, first_stamp + steps):
            rows, wanted = (t.to(device) for t in random_step(n_rows, n_slots, k, gen))
            want = hot_step_torch(held, last_used, rows, wanted, stamp)
            got = hot_step_triton(held_b, last_b, rows, wanted, stamp)
            where = f"R={n_rows} H={n_slots} K={k} stamp={stamp}"
            assert torch.equal(got.slots, want.slots), f"slots differ at {where}"
            assert torch.equal(got.miss, want.miss), f"miss differs at {where}"
            assert torch.equal(held_b, held), f"held differs at {where}"
            assert torch.equal(last_b, last_used), f"last_used differs at {where}"


# TRITON_INTERPRET must be set before triton is imported, and this process may have imported
# it already, so the interpreter run gets a fresh process.
_INTERPRETED = """
import sys
sys.path.insert(0, sys.argv[1])
from sparse.test_hot_step import compare_triton_to_torch
small = [(3, 1, 1), (4, 5, 3), (6, 8, 8), (5, 13, 6), (8, 32, 16)]
compare_triton_to_torch("cpu", small, steps=4)
# Several tiles of the rank loop, K == H, and stamps beyond 32 bits.
compare_triton_to_torch("cpu", [(5, 70, 24), (3, 128, 128)], steps=3, first_stamp=2**40)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_interpreted_matches_torch() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tests_dir = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, tests_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_compiled_matches_torch() -> None:
    compare_triton_to_torch("cuda", [(300, 64, 16), (256, 64, 64), (64, 1024, 128)], 6)
    torch.cuda.synchronize()


@pytest.mark.cuda
@needs_cuda
def test_dispatcher_falls_back_to_torch_above_the_triton_limit() -> None:
    held = torch.full((2, MAX_TRITON_SLOTS + 1), -1, dtype=torch.int64, device="cuda")
    last_used = torch.full_like(held, -1)
    wanted = torch.tensor([[7, -1, 8]], device="cuda")
    result = hot_step(held, last_used, torch.tensor([1], device="cuda"), wanted, 0)
    assert result.slots.tolist() == [[0, -1, 1]]
    assert held[1, :3].tolist() == [7, 8, -1]


def test_triton_refuses_rows_beyond_its_limit() -> None:
    held = torch.full((1, MAX_TRITON_SLOTS + 1), -1, dtype=torch.int64)
    last_used = torch.full_like(held, -1)
    wanted = torch.tensor([[1]])
    with pytest.raises(InvalidArgumentError, match=r"at most 1024 slots|needs triton"):
        hot_step_triton(held, last_used, torch.tensor([0]), wanted, 0)


def test_dispatcher_result_contract() -> None:
    """The dispatcher on this machine's device (Triton on CUDA, else torch), padding in rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    held = torch.full((3, 4), -1, dtype=torch.int64, device=device)
    last_used = torch.full_like(held, -1)
    rows = torch.tensor([2, 0], device=device)
    wanted = torch.tensor([[1, -1, 2], [-1, -1, -1]], device=device)
    result = hot_step(held, last_used, rows, wanted, 0)
    assert result.slots.tolist() == [[0, -1, 1], [-1, -1, -1]]
    assert result.miss.tolist() == [[True, False, True], [False, False, False]]
    assert held.tolist() == [[-1] * 4, [-1] * 4, [1, 2, -1, -1]]


def valid_inputs() -> dict[str, object]:
    return {
        "held": torch.tensor([[1, 2, -1], [3, -1, -1]]),
        "last_used": torch.tensor([[0, 1, -1], [2, -1, -1]]),
        "rows": torch.tensor([1, 0]),
        "wanted": torch.tensor([[3, 4], [-1, 5]]),
        "stamp": 3,
    }


BAD_INPUTS = {
    "held dtype": ("held", torch.tensor([[1, 2, -1], [3, -1, -1]], dtype=torch.int32), "int64"),
    "last_used shape": ("last_used", torch.full((2, 4), -1), "one shape"),
    "held not 2-D": ("held", torch.full((2, 3, 1), -1), "one shape"),
    "rows not 1-D": ("rows", torch.tensor([[1, 0]]), r"\(B,\)"),
    "wanted rows": ("wanted", torch.tensor([[3, 4]]), r"\(B, K\)"),
    "K > H": ("wanted", torch.tensor([[3, 4, 6, 7], [-1, 5, 6, 7]]), "K=4"),
    "wanted dtype": ("wanted", torch.tensor([[3.0, 4.0], [-1.0, 5.0]]), "int64"),
    "row too big": ("rows", torch.tensor([2, 0]), "rows must lie"),
    "row negative": ("rows", torch.tensor([-1, 0]), "rows must lie"),
    "row repeated": ("rows", torch.tensor([1, 1]), "distinct"),
    "wanted < -1": ("wanted", torch.tensor([[3, -2], [-1, 5]]), ">= 0"),
    "page repeated": ("wanted", torch.tensor([[3, 4], [5, 5]]), "wanted repeats"),
    "held repeats": ("held", torch.tensor([[1, 1, -1], [3, -1, -1]]), "held repeats"),
    "stamp equal": ("stamp", 2, "greater than every stamp"),
    "stamp smaller": ("stamp", 0, "greater than every stamp"),
    "stamp float": ("stamp", 3.0, "must be an int"),
    "stamp bool": ("stamp", True, "must be an int"),
    "other device": ("rows", torch.tensor([1, 0], device="meta"), "is on meta"),
    "not a tensor": ("wanted", [[3, 4], [-1, 5]], "torch.Tensor"),
}


@pytest.mark.parametrize("step_fn", [hot_step, hot_step_torch, hot_step_triton])
@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_is_refused_before_any_change(step_fn: StepFn, case: str) -> None:
    name, value, message = BAD_INPUTS[case]
    inputs = valid_inputs()
    inputs[name] = value
    held_before = inputs["held"].clone()  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match=message):
        step_fn(**inputs)
    assert torch.equal(inputs["held"], held_before)  # type: ignore[arg-type]


def test_valid_inputs_are_accepted() -> None:
    """The base of the bad-input cases is itself valid, so each case tests only its change."""
    result = hot_step_torch(**valid_inputs())  # type: ignore[arg-type]
    assert result.slots.tolist() == [[0, 1], [-1, 2]]
