"""A checkpoint's ``tokenizer.json`` through ``tokenizers``, and text prompts encoded with it.

A trace's text prompts (``"text"`` instead of ``"tokens"``) are encoded before the run; without a
tokenizer they stay text and each such request fails on its own when it arrives (see
:class:`~hicache.workloads.arrivals.TraceReplay`), the others are served.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hicache.errors import CheckpointError
from hicache.workloads.traces import TraceRequest

__all__ = ["load_tokenizer", "tokenize_trace"]


def load_tokenizer(directory: Path) -> Any | None:
    """The ``tokenizers.Tokenizer`` of ``directory/tokenizer.json``, None without one;
    CheckpointError when the file is there but not a tokenizer."""
    path = directory / "tokenizer.json"
    if not path.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CheckpointError(
            f"{path} needs the tokenizers package: pip install 'hicache[hf]'"
        ) from None

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclass for any bad file
        raise CheckpointError(f"{path} is not a tokenizers file: {exc}") from None


def tokenize_trace(
    requests: list[TraceRequest], tokenizer: Any | None, vocab_size: int
) -> list[TraceRequest]:
    """``requests`` with each text prompt encoded (special tokens as the tokenizer adds them);
    unchanged without a tokenizer. CheckpointError when the tokenizer yields ids the model's
    vocabulary lacks (a tokenizer of another model)."""
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
