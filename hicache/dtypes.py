"""What a stored KV page's bytes are: their element type and their order, as stable codes.

Both enums are independent of any tensor library (``DType.to_torch`` imports torch only when
called). ``Layout`` is re-exported by :mod:`hicache.layouts`, whose functions give each layout
its shapes and offsets.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

from hicache.errors import InvalidArgumentError

__all__ = ["CodedEnum", "DType", "Layout"]

E = TypeVar("E", bound="CodedEnum")


class CodedEnum(enum.Enum):
    """An enum whose members carry a ``label`` (its name in configs and reports) and a
    ``code`` (its stable number in page headers); each member's value starts with both."""

    label: str
    code: int

    @classmethod
    def from_code(cls: type[E], code: int) -> E:
        for member in cls:
            if member.code == code:
                return member
        raise InvalidArgumentError(f"unknown {cls._kind()} code {code}")

    @classmethod
    def from_label(cls: type[E], label: str) -> E:
        for member in cls:
            if member.label == label:
                return member
        known = ", ".join(m.label for m in cls)
        raise InvalidArgumentError(f"unknown {cls._kind()} {label!r}; known: {known}")

    @classmethod
    def _kind(cls) -> str:
        return cls.__name__.lower()


class DType(CodedEnum):
    """Element type of a page payload. ``code`` is the stable on-disk number."""

    UINT8 = ("uint8", 1, 1)
    INT8 = ("int8", 2, 1)
    FLOAT8_E4M3FN = ("float8_e4m3fn", 3, 1)
    FLOAT8_E5M2 = ("float8_e5m2", 4, 1)
    FLOAT16 = ("float16", 5, 2)
    BFLOAT16 = ("bfloat16", 6, 2)
    FLOAT32 = ("float32", 7, 4)
    INT32 = ("int32", 8, 4)
    INT64 = ("int64", 9, 8)

    def __init__(self, label: str, code: int, itemsize: int) -> None:
        self.label = label
        self.code = code
        self.itemsize = itemsize

    @classmethod
    def from_torch(cls, dtype: Any) -> DType:
        """The member for a ``torch.dtype`` (``torch.bfloat16`` -> ``DType.BFLOAT16``)."""
        return cls.from_label(str(dtype).removeprefix("torch."))

    def to_torch(self) -> Any:
        import torch

        return getattr(torch, self.label)


class Layout(CodedEnum):
    """How a page's bytes are ordered. ``code`` is the stable on-disk number.

    - ``LAYER_FIRST``: [layer][token][...]: what attention kernels compute in.
    - ``PAGE_FIRST``: [page][token][layer][...]: one page is contiguous.
    - ``PAGE_FIRST_DIRECT``: [page][layer][token][...]: one page is contiguous, grouped by layer.
    - ``RAW``: opaque bytes with no KV structure (tests, plugins, non-KV state).
    """

    RAW = ("raw", 0)
    LAYER_FIRST = ("layer_first", 1)
    PAGE_FIRST = ("page_first", 2)
    PAGE_FIRST_DIRECT = ("page_first_direct", 3)

    def __init__(self, label: str, code: int) -> None:
        self.label = label
        self.code = code
