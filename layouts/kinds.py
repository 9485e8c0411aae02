"""The host-memory layouts a KV page can be stored in."""

from __future__ import annotations

import enum

__all__ = ["Layout"]


class Layout(enum.Enum):
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

    @classmethod
    def from_code(cls, code: int) -> Layout:
        for member in cls:
            if member.code == code:
                return member
        raise ValueError(f"unknown layout code {code}")

    @classmethod
    def from_label(cls, label: str) -> Layout:
        for member in cls:
            if member.label == label:
                return member
        known = ", ".join(m.label for m in cls)
        raise ValueError(f"unknown layout {label!r}; known: {known}")
