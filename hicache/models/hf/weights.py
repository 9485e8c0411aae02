"""A checkpoint's tensors: ``model.safetensors`` or the shards a ``model.safetensors.index.json``
names, read through ``safetensors`` one tensor at a time from the memory-mapped files.

:func:`check_tensors` compares the names and shapes in the files' headers with what the model
expects, so a missing, misshapen or foreign tensor is refused before any tensor is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hicache.errors import CheckpointError

__all__ = ["Shapes", "TensorFiles", "check_tensors", "decoder_shapes"]

Shapes = dict[str, tuple[int, ...]]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_LISTED = 5  # names shown in an error before "and N more"


class TensorFiles:
    """Which file holds each tensor, and its shape, from the safetensors headers alone."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.file_of = _file_map(directory)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file, names in _by_file(self.file_of).items():
            with _open(file) as handle:
                for name in names:
                    if name not in handle.keys():  # noqa: SIM118 - a safe_open has no __contains__
                        raise CheckpointError(
                            f"{_INDEX} lists {name!r} in {file.name}, which lacks it"
                        )
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())

    def load(
        self, names: Mapping[str, str], dtype: torch.dtype, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """The checkpoint tensors ``names`` maps to (our name -> checkpoint name), each in
        ``dtype`` on ``device``."""
        wanted: dict[Path, list[tuple[str, str]]] = {}
        for ours, theirs in names.items():
            wanted.setdefault(self.file_of[theirs], []).append((ours, theirs))
        out: dict[str, torch.Tensor] = {}
        for file, pairs in wanted.items():
            with _open(file) as handle:
                for ours, theirs in pairs:
                    out[ours] = handle.get_tensor(theirs).to(device, dtype)
        return out


def check_tensors(
    files: TensorFiles,
    expected: Mapping[str, tuple[int, ...]],
    unread: Callable[[str], bool] = lambda name: False,
) -> None:
    """CheckpointError listing every expected tensor the files lack, every one whose shape
    differs, and every tensor of the files the model would not read (but those ``unread``
    accepts: parts of the checkpoint the model knowingly leaves aside)."""
    missing = sorted(name for name in expected if name not in files.shapes)
    wrong = sorted(
        f"{name} {list(files.shapes[name])} (expected {list(shape)})"
        for name, shape in expected.items()
        if name in files.shapes and files.shapes[name] != shape
    )
    unused = sorted(name for name in files.shapes if name not in expected and not unread(name))
    problems = [
        f"{label}: {_listed(names)}"
        for label, names in (("missing", missing), ("wrong shape", wrong), ("unexpected", unused))
        if names
    ]
    if problems:
        raise CheckpointError(
            f"{files.directory}: tensors do not match the config; " + "; ".join(problems)
        )


def decoder_shapes(
    vocab: int,
    hidden: int,
    tied: bool,
    final_norm: str,
    layers: int,
    layer: Callable[[int], Shapes],
) -> Shapes:
    """A decoder checkpoint's tensors (transformers' names): the embedding, the final norm
    ``model.{final_norm}.weight``, ``lm_head`` unless ``tied``, and ``layer(i)``'s tensors
    below ``model.layers.{i}.``."""
    shapes: Shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        f"model.{final_norm}.weight": (hidden,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer(i).items()})
    return shapes


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown} and {len(names) - _LISTED} more"


def _file_map(directory: Path) -> dict[str, Path]:
    index = directory / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index: {exc!r}") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        files = {name: _inside(directory, file) for name, file in weight_map.items()}
        return files
    single = directory / _SINGLE
    if not single.exists():
        raise CheckpointError(f"{directory} has neither {_SINGLE} nor {_INDEX}")
    with _open(single) as handle:
        return dict.fromkeys(handle.keys(), single)


def _inside(directory: Path, name: str) -> Path:
    """A shard path the index names, refused when it leaves the directory or is absent."""
    path = (directory / name).resolve()
    if path.parent != directory.resolve():
        raise CheckpointError(f"{_INDEX} names {name!r}, outside the checkpoint directory")
    if not path.is_file():
        raise CheckpointError(f"{_INDEX} names shard {name!r}, which does not exist")
    return path


def _by_file(file_of: Mapping[str, Path]) -> dict[Path, list[str]]:
    out: dict[Path, list[str]] = {}
    for name, file in file_of.items():
        out.setdefault(file, []).append(name)
    return out


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    """``safe_open`` on one file, its failures as CheckpointError naming the file."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise CheckpointError(
            "--model needs the safetensors package: pip install 'hicache[hf]'"
        ) from None
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path.name} is not a safetensors file: {exc}") from None
    with handle:
        yield handle
