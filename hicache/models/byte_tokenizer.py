"""Text for the seeded presets, which have no tokenizer of their own: UTF-8 bytes as token ids.

Encoding gives each byte of the text's UTF-8 form as an id (0-255); decoding turns id ``i``
into the byte ``i % 256`` and the bytes into text (a sequence that is not UTF-8 shows as
U+FFFD). The presets' vocabularies are larger than 256, so any id they generate decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ByteTokenizer"]


@dataclass(frozen=True, slots=True)
class Encoding:
    ids: list[int]


class ByteTokenizer:
    """The two calls the server makes of a tokenizer: ``encode(text).ids`` and ``decode``."""

    def encode(self, text: str) -> Encoding:
        return Encoding(list(text.encode("utf-8")))

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")
