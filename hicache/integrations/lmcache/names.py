"""Storage names for LMCache keys: valid hicache keys that give the LMCache key back.

LMCache names a chunk ``model@world_size@worker_id@chunk_hash@dtype[@tag%value...]``: ``@``,
``%``, ``/`` (in model names) and any other character may appear, and hicache keys allow only
``[A-Za-z0-9._-]``. A name is ``lmc-{namespace}-k{escaped}``, where every character outside
``[A-Za-z0-9-]`` becomes ``_`` and two lowercase hex digits per UTF-8 byte. ``.`` and ``_`` are
escaped too, so a name never holds ``..`` and ``_`` always starts an escape: each key has one
name and :meth:`KeyNames.key_of` can give it back (``list()`` needs that).

A key whose escaped form would pass hicache's 250-character limit (a long model path with
several tags) is stored as ``lmc-{namespace}-h{sha256}``: still found by the key, but not
listable, since a digest cannot be reversed.

The namespace is a digest of what decides how a chunk's bytes are read (LMCache's memory
format, dtypes and full-chunk shapes); model, world size and rank are already in the key. Two
engines with different formats never see each other's objects, and each page header repeats
the format, dtype and shape, so a copied or renamed object still reads as a miss.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Sequence

from hicache.keys import KEY_MAX_LEN

__all__ = ["KeyNames", "escape_key", "namespace_tag", "unescape_key"]

_SAFE = frozenset(string.ascii_letters + string.digits + "-")
_HEX = frozenset("0123456789abcdef")
_DOMAIN = "hicache-lmcache-v1"
_ESCAPED = "k"  # marks a reversible name
_HASHED = "h"  # marks a digest name (key too long to escape)


def namespace_tag(fmt: str, dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> str:
    """16 hex digits naming one chunk format: memory format, dtypes and full-chunk shapes."""
    text = "\0".join(
        [_DOMAIN, fmt, ",".join(dtypes), ";".join("x".join(map(str, s)) for s in shapes)]
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def escape_key(key: str) -> str:
    """``key`` with every character outside ``[A-Za-z0-9-]`` as ``_hh`` per UTF-8 byte."""
    out: list[str] = []
    for char in key:
        if char in _SAFE:
            out.append(char)
        else:
            out.extend(f"_{byte:02x}" for byte in char.encode("utf-8"))
    return "".join(out)


def unescape_key(escaped: str) -> str | None:
    """The key :func:`escape_key` made ``escaped`` from; None if no key gives that form.

    Strict on purpose: a name that is not the one escaping would produce (upper-case hex, an
    escaped safe character) is someone else's object, and listing it would report a key whose
    own name does not exist.
    """
    raw = bytearray()
    i = 0
    while i < len(escaped):
        char = escaped[i]
        if char in _SAFE:
            raw.append(ord(char))
            i += 1
        elif char == "_" and i + 3 <= len(escaped) and set(escaped[i + 1 : i + 3]) <= _HEX:
            raw.append(int(escaped[i + 1 : i + 3], 16))
            i += 3
        else:
            return None
    try:
        key = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return key if escape_key(key) == escaped else None


class KeyNames:
    """Names of one namespace's objects, and the keys they stand for."""

    def __init__(self, tag: str) -> None:
        self.prefix = f"lmc-{tag}-"
        self._room = KEY_MAX_LEN - len(self.prefix) - 1

    def name(self, key: str) -> str:
        """The storage name of LMCache key string ``key``."""
        escaped = escape_key(key)
        if len(escaped) <= self._room:
            return self.prefix + _ESCAPED + escaped
        return self.prefix + _HASHED + hashlib.sha256(key.encode("utf-8")).hexdigest()

    def key_of(self, name: str) -> str | None:
        """The key string stored under ``name``; None for a digest name or a foreign one."""
        if not name.startswith(self.prefix + _ESCAPED):
            return None
        return unescape_key(name[len(self.prefix) + 1 :])

    def is_digest(self, name: str) -> bool:
        return name.startswith(self.prefix + _HASHED)
