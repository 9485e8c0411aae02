"""Request traces: the ``TraceRequest`` record and its JSONL files.

A trace is a list of requests ``{"id", "namespace", "tokens", "output_tokens"}``, one JSON object
per line on disk; an empty namespace is the default one. A request may give its prompt as
``"text"`` instead of ``"tokens"``, for a model with a tokenizer to encode. Reading checks every
line and raises :class:`~hicache.errors.TraceFormatError` naming the first bad line. The
generators that make traces live in :mod:`hicache.workloads.synthetic`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hicache.errors import CheckpointError, TraceFormatError

__all__ = [
    "tokenize_trace",
    "TOKEN_LIMIT",
    "TraceRequest",
    "dump_trace",
    "format_trace",
    "load_trace",
    "parse_trace",
]

TOKEN_LIMIT = 1 << 32  # token ids are uint32, as the radix keys pack them


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: its prompt and the tokens it generated, in one cache namespace."""

    id: str
    namespace: str
    tokens: list[int]  # empty for a text prompt not tokenized yet
    output_tokens: list[int]
    text: str | None = None  # the prompt as text, when the trace gave it so


# ----- JSONL ----------------------------------------------------------------------------------
def format_trace(requests: Iterable[TraceRequest]) -> Iterator[str]:
    """Each request as one JSON line (with its newline)."""
    for req in requests:
        row: dict[str, Any] = {"id": req.id, "namespace": req.namespace}
        row |= {"tokens": req.tokens} if req.text is None else {"text": req.text}
        row["output_tokens"] = req.output_tokens
        yield json.dumps(row, separators=(",", ":")) + "\n"


def dump_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write ``requests`` to ``path`` as JSONL, replacing the file."""
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
        if type(t) is not int or not 0 <= t < TOKEN_LIMIT:
            raise TraceFormatError(line, f"{name!r} holds {t!r}: tokens are ints in [0, 2**32)")
    return value


def _parse_line(text: str, line: int) -> TraceRequest:
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise TraceFormatError(line, f"not JSON ({exc})") from None
    except RecursionError:
        raise TraceFormatError(line, "JSON nested too deeply") from None
    if not isinstance(row, dict):
        raise TraceFormatError(line, f"expected a JSON object, got {type(row).__name__}")
    for name in ("id", "namespace", "output_tokens"):
        if name not in row:
            raise TraceFormatError(line, f"missing field {name!r}")
    if ("tokens" in row) == ("text" in row):
        raise TraceFormatError(line, "give the prompt as 'tokens' or as 'text', one of them")
    texts = ("id", "namespace", "text") if "text" in row else ("id", "namespace")
    for name in texts:
        if not isinstance(row[name], str):
            raise TraceFormatError(line, f"{name!r} must be a string")
        try:
            row[name].encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape, e.g. "\ud800"
            raise TraceFormatError(line, f"{name!r} is not valid Unicode") from None
    output = _token_list(row, "output_tokens", line, allow_empty=True)
    if "text" in row:
        if not row["text"]:
            raise TraceFormatError(line, "'text' is empty: a prompt needs at least one token")
        return TraceRequest(row["id"], row["namespace"], [], output, row["text"])
    tokens = _token_list(row, "tokens", line, allow_empty=False)
    return TraceRequest(row["id"], row["namespace"], tokens, output)


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Requests from JSONL text; blank lines are skipped, anything else must be a request.

    Text that is not UTF-8 (a binary file opened as a trace) is refused with its line number.
    """
    out: list[TraceRequest] = []
    texts = iter(lines)
    number = 0
    while True:
        try:
            text = next(texts)
        except StopIteration:
            return out
        except UnicodeDecodeError:
            raise TraceFormatError(number + 1, "not UTF-8 text") from None
        number += 1
        if text.strip():
            out.append(_parse_line(text, number))


def load_trace(path: str | Path | IO[str]) -> list[TraceRequest]:
    """Read a JSONL trace from a path or an open text file."""
    if isinstance(path, str | Path):
        with open(path, "rb") as f:
            return parse_trace(_utf8_lines(f))
    return parse_trace(path)


def _utf8_lines(raw: Iterable[bytes]) -> Iterator[str]:
    for number, line in enumerate(raw, start=1):
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceFormatError(number, "not UTF-8 text") from None


def tokenize_trace(
    requests: list[TraceRequest], tokenizer: Any | None, vocab_size: int
) -> list[TraceRequest]:
    """``requests`` with each text prompt encoded by a checkpoint's ``tokenizer`` (special tokens
    as it adds them); unchanged without a tokenizer: each text request then fails on its own
    when it arrives (:class:`~hicache.workloads.arrivals.TraceReplay`), the others are served.
    CheckpointError when the tokenizer yields ids the model's vocabulary lacks (a tokenizer of
    another model)."""
    if tokenizer is None:
        return requests
    out = []
    for request in requests:
        if request.text is None:
            out.append(request)
            continue
        ids = tokenizer.encode(request.text).ids
        if any(not 0 <= t < vocab_size for t in ids):
            raise CheckpointError(
                f"the tokenizer encoded request {request.id!r} to ids outside the model's "
                f"vocabulary of {vocab_size}: tokenizer.json belongs to another model"
            )
        out.append(dataclasses.replace(request, tokens=list(ids)))
    return out
