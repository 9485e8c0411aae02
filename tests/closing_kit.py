"""Closing what a test opened, for fixtures that hand a test a list to put it in."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

Opened = TypeVar("Opened")


@contextlib.contextmanager
def closed_on_exit(close: Callable[[Opened], object]) -> Iterator[list[Opened]]:
    """A list for the things a test opens; ``close`` is called on each on the way out, in the
    order they were added."""
    opened: list[Opened] = []
    yield opened
    for thing in opened:
        close(thing)
