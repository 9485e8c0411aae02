"""Upper bounds of the benchmarks' sizes, shared by their parsers (``bench backends``, ``codec``,
``tools``; ``MAX_REPEATS``: every benchmark's ``--repeats`` unless it sets a lower one); what a
run needs together is checked before it starts."""

from __future__ import annotations

__all__ = ["MAX_OBJECTS", "MAX_OBJECT_BYTES", "MAX_REPEATS"]

MAX_OBJECTS = 10_000_000
MAX_OBJECT_BYTES = 1 << 30
MAX_REPEATS = 1000
