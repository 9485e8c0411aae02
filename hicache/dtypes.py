"""Element types of stored KV pages, independent of any tensor library."""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["DType"]


class DType(enum.Enum):
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
    def from_code(cls, code: int) -> DType:
        for member in cls:
            if member.code == code:
                return member
        raise ValueError(f"unknown dtype code {code}")

    @classmethod
    def from_label(cls, label: str) -> DType:
        for member in cls:
            if member.label == label:
                return member
        known = ", ".join(m.label for m in cls)
        raise ValueError(f"unknown dtype {label!r}; known: {known}")

    @classmethod
    def from_torch(cls, dtype: Any) -> DType:
        """The member for a ``torch.dtype`` (``torch.bfloat16`` -> ``DType.BFLOAT16``)."""
        return cls.from_label(str(dtype).removeprefix("torch."))

    def to_torch(self) -> Any:
        import torch

        return getattr(torch, self.label)
