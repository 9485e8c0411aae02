"""A checkpoint's ``tokenizer.json`` through ``tokenizers`` (a trace's text prompts are encoded
with it by :func:`~hicache.workloads.traces.tokenize_trace`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hicache.errors import CheckpointError

__all__ = ["load_tokenizer"]


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
