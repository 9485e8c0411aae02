"""Request traces for replaying through the radix tree: synthetic workloads and JSONL files.

A trace is a list of requests ``{"id", "namespace", "tokens", "output_tokens"}``, one JSON object
per line on disk. The generators are seeded and deterministic (numpy's PCG64 stream is stable
across platforms), so a benchmark figure can be reproduced from its command line alone.

Every workload issues ``clients x rounds`` requests:

- ``multiturn``: each client holds one chat; its round ``r`` prompt is a system prompt, the whole
  history so far (earlier user turns and outputs) and a new user turn. Requests are interleaved
  round by round (round 1 of every client, then round 2, ...), as concurrent chats arrive.
- ``fewshot``: a few long templates (``clients // 16``) each followed by a short question.
- ``longdoc``: several long documents (``clients // 8``), each asked many questions.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from hicache.errors import InvalidArgumentError, TraceFormatError

__all__ = [
    "TraceRequest",
    "WorkloadConfig",
    "WorkloadKind",
    "dump_trace",
    "format_trace",
    "generate_trace",
    "load_trace",
    "parse_trace",
]

_TOKEN_LIMIT = 1 << 32

# Token counts (inclusive ranges) shaped like chat traffic; generators draw uniformly in them.
_SYSTEM_PROMPTS = 4
_SYSTEM_LEN = (250, 350)
_USER_TURN_LEN = (50, 200)
_CHAT_OUTPUT_LEN = (100, 300)
_TEMPLATE_LEN = (1000, 3000)
_QUESTION_LEN = (20, 100)
_SHORT_OUTPUT_LEN = (10, 100)
_DOCUMENT_LEN = (4000, 8000)
_ANSWER_LEN = (50, 200)


class WorkloadKind(enum.Enum):
    MULTITURN = "multiturn"
    FEWSHOT = "fewshot"
    LONGDOC = "longdoc"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: its prompt and the tokens it generated, in one cache namespace."""

    id: str
    namespace: str
    tokens: list[int]
    output_tokens: list[int]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    kind: WorkloadKind = WorkloadKind.MULTITURN
    clients: int = 64
    rounds: int = 5
    seed: int = 0
    namespaces: int = 2  # clients (or requests) spread over this many tenants
    vocab: int = 32000

    def __post_init__(self) -> None:
        if not isinstance(self.kind, WorkloadKind):
            raise InvalidArgumentError("kind must be a WorkloadKind")
        for name in ("clients", "rounds", "namespaces", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if self.vocab > _TOKEN_LIMIT:
            raise InvalidArgumentError(f"vocab must be at most 2**32, got {self.vocab}")


# ----- generation -----------------------------------------------------------------------------
class _Draw:
    """Random token spans and lengths from one seeded stream."""

    def __init__(self, config: WorkloadConfig) -> None:
        self._rng = np.random.default_rng(config.seed)
        self._vocab = config.vocab

    def length(self, bounds: tuple[int, int]) -> int:
        return int(self._rng.integers(bounds[0], bounds[1] + 1))

    def tokens(self, bounds: tuple[int, int]) -> list[int]:
        n = self.length(bounds)
        return [int(t) for t in self._rng.integers(0, self._vocab, size=n)]

    def index(self, n: int) -> int:
        return int(self._rng.integers(0, n))


def _multiturn(config: WorkloadConfig, draw: _Draw) -> list[TraceRequest]:
    systems = [draw.tokens(_SYSTEM_LEN) for _ in range(_SYSTEM_PROMPTS)]
    histories = [list(systems[c % _SYSTEM_PROMPTS]) for c in range(config.clients)]
    out: list[TraceRequest] = []
    for r in range(config.rounds):
        for c in range(config.clients):
            prompt = histories[c] + draw.tokens(_USER_TURN_LEN)
            output = draw.tokens(_CHAT_OUTPUT_LEN)
            histories[c] = prompt + output
            ns = f"tenant-{c % config.namespaces}"
            out.append(TraceRequest(f"c{c}-r{r}", ns, prompt, output))
    return out


def _shared_prefix(
    config: WorkloadConfig,
    draw: _Draw,
    prefix_len: tuple[int, int],
    per_prefix: int,
    suffix: tuple[tuple[int, int], tuple[int, int]],
) -> list[TraceRequest]:
    """Requests that each pick one of a few long prefixes and add a short unique question."""
    prefixes = [draw.tokens(prefix_len) for _ in range(max(1, config.clients // per_prefix))]
    question_len, output_len = suffix
    out: list[TraceRequest] = []
    for i in range(config.clients * config.rounds):
        prefix = prefixes[draw.index(len(prefixes))]
        ns = f"tenant-{draw.index(config.namespaces)}"
        prompt = prefix + draw.tokens(question_len)
        out.append(TraceRequest(f"q{i}", ns, prompt, draw.tokens(output_len)))
    return out


def generate_trace(config: WorkloadConfig) -> list[TraceRequest]:
    """A synthetic trace of ``config.clients * config.rounds`` requests."""
    draw = _Draw(config)
    if config.kind is WorkloadKind.MULTITURN:
        return _multiturn(config, draw)
    if config.kind is WorkloadKind.FEWSHOT:
        return _shared_prefix(config, draw, _TEMPLATE_LEN, 16, (_QUESTION_LEN, _SHORT_OUTPUT_LEN))
    return _shared_prefix(config, draw, _DOCUMENT_LEN, 8, (_QUESTION_LEN, _ANSWER_LEN))


# ----- JSONL ----------------------------------------------------------------------------------
def format_trace(requests: Iterable[TraceRequest]) -> Iterator[str]:
    """Each request as one JSON line (with its newline)."""
    for req in requests:
        row = {
            "id": req.id,
            "namespace": req.namespace,
            "tokens": req.tokens,
            "output_tokens": req.output_tokens,
        }
        yield json.dumps(row, separators=(",", ":")) + "\n"


def dump_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(format_trace(requests))


def _token_list(row: dict[str, Any], name: str, line: int, allow_empty: bool) -> list[int]:
    value = row[name]
    if not isinstance(value, list):
        raise TraceFormatError(line, f"{name!r} must be a list of ints")
    if not value and not allow_empty:
        raise TraceFormatError(line, f"{name!r} is empty: a prompt needs at least one token")
    for t in value:
        # bool is an int subclass, but ``true`` in a token list is a broken trace.
        if type(t) is not int or not 0 <= t < _TOKEN_LIMIT:
            raise TraceFormatError(line, f"{name!r} holds {t!r}: tokens are ints in [0, 2**32)")
    return value


def _parse_line(text: str, line: int) -> TraceRequest:
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise TraceFormatError(line, f"not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise TraceFormatError(line, f"expected a JSON object, got {type(row).__name__}")
    for name in ("id", "namespace", "tokens", "output_tokens"):
        if name not in row:
            raise TraceFormatError(line, f"missing field {name!r}")
    for name in ("id", "namespace"):
        if not isinstance(row[name], str):
            raise TraceFormatError(line, f"{name!r} must be a string")
    tokens = _token_list(row, "tokens", line, allow_empty=False)
    output = _token_list(row, "output_tokens", line, allow_empty=True)
    return TraceRequest(row["id"], row["namespace"], tokens, output)


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Requests from JSONL text; blank lines are skipped, anything else must be a request."""
    out: list[TraceRequest] = []
    for number, text in enumerate(lines, start=1):
        if text.strip():
            out.append(_parse_line(text, number))
    return out


def load_trace(path: str | Path | IO[str]) -> list[TraceRequest]:
    """Read a JSONL trace from a path or an open text file."""
    if isinstance(path, str | Path):
        with open(path, encoding="utf-8") as f:
            return parse_trace(f)
    return parse_trace(path)
