"""Typed errors of hicache.

Every error the library raises on purpose derives from :class:`HiCacheError`. Where a built-in
exception already says the same thing (``ValueError`` for bad input, ``LookupError`` for an
unknown name), the error derives from it too, so callers that catch the built-in keep working.
"""

from __future__ import annotations

__all__ = [
    "BackendClosedError",
    "BackendError",
    "BackendLoadError",
    "BackendNotFoundError",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "BadMagicError",
    "BufferSizeError",
    "CheckpointError",
    "CodecError",
    "ConfigError",
    "DoubleFreeError",
    "CorruptHeaderError",
    "ForeignPageError",
    "HiCacheError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidTokenError",
    "LayoutError",
    "MissingSlotError",
    "PayloadChecksumError",
    "ReadOnlyStoreError",
    "TraceFormatError",
    "TruncatedPageError",
    "UnsupportedLayoutError",
    "UnsupportedVersionError",
]


class HiCacheError(Exception):
    """Root of every error hicache raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value or combination is invalid; the message says what to change."""


class CheckpointError(ConfigError):
    """A model checkpoint directory cannot be served: its config, tensors or tokenizer name an
    unsupported architecture, are missing, or do not match."""


class InvalidArgumentError(HiCacheError, ValueError):
    """A call received arguments that cannot be right (mismatched lengths, wrong types)."""


class InvalidKeyError(InvalidArgumentError):
    """A storage key is empty, too long, or uses characters outside the key alphabet."""


class InvalidTokenError(InvalidArgumentError):
    """A token id is negative, not an integer, or does not fit in 32 bits."""


class DoubleFreeError(InvalidArgumentError):
    """Slots or a request row were freed that are already free; nothing was changed."""


class TraceFormatError(InvalidArgumentError):
    """A line of a request trace (JSONL) is not JSON or lacks a field; ``line`` is 1-based."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(f"trace line {line}: {problem}")
        self.line = line


class MissingSlotError(InvalidArgumentError, RuntimeError):
    """A model was asked to read a pool at a position its chunk gives no slot for (a -1 inside
    a window it reads). A RuntimeError too: the caller's pool bookkeeping went wrong, not one
    argument's value."""


class LayoutError(InvalidArgumentError):
    """A KV buffer, page or index list does not fit its layout spec; no buffer was changed."""


class UnsupportedLayoutError(LayoutError):
    """A layout, or a pair of layouts, has no implementation (``RAW`` holds no KV structure)."""


class BufferSizeError(InvalidArgumentError):
    """A caller buffer cannot hold the object read into it.

    ``needed`` is the object's size in bytes, so the caller can retry with a larger buffer.
    """

    def __init__(self, key: str, needed: int, capacity: int) -> None:
        super().__init__(f"object {key!r} is {needed} bytes; the buffer holds {capacity}")
        self.key = key
        self.needed = needed
        self.capacity = capacity


class BackendError(HiCacheError):
    """A storage backend failed in a way the caller should know about."""


class BackendUnavailableError(BackendError):
    """The backend's service or storage cannot be reached or opened."""


class BackendClosedError(BackendError):
    """A call was made on a backend after ``close()``."""


class BackendNotFoundError(BackendError, LookupError):
    """No registered backend has this name or URL scheme."""


class BackendLoadError(BackendError, ImportError):
    """A registered backend could not be imported (usually a missing optional dependency)."""


class BackendRegistrationError(BackendError):
    """A backend name is already registered and replacing it was not asked for."""


class ReadOnlyStoreError(BackendError):
    """A write (put, delete, removing files) on a backend opened read-only; nothing changed.

    Not a :class:`BackendUnavailableError`: the store is there and reads work, so a caller
    that falls back when storage cannot be reached should not treat it as gone.
    """


class CodecError(HiCacheError):
    """A stored page cannot be decoded. Callers treat it as a miss and count it."""


class BadMagicError(CodecError):
    """The object does not start with the hicache page magic: not a hicache page."""


class UnsupportedVersionError(CodecError):
    """The page was written in a format version this build cannot read."""


class CorruptHeaderError(CodecError):
    """The header's checksum fails or one of its fields is out of range."""


class ForeignPageError(CodecError):
    """The page is intact but belongs to another key or another model/format."""


class PageKindMismatchError(ForeignPageError):
    """An intact page of this very key whose content (pool, dtype, shape, layout) is not what
    the reader expects: written by a reader of another configuration, not damaged."""


class TruncatedPageError(CodecError):
    """The object is shorter than its header says."""


class PayloadChecksumError(CodecError):
    """The payload does not match the checksum recorded in the header."""
