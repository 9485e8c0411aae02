"""A one-line progress bar on stderr for long store walks.

Silent unless stderr is a terminal (so pipes, logs and tests get clean output) or when the
caller turns it off (``--quiet``). The total is often unknown, since stores are streamed rather
than counted first; the line then shows counts and rates only.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_REDRAW_S = 0.1  # at most ten redraws a second: drawing must cost nothing next to the work


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


class Progress:
    """``advance(objects, nbytes)`` as work completes; ``close()`` ends the line."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and _is_tty(self.stream)
        self.label = label
        self.total = total
        self.objects = 0
        self.nbytes = 0
        self._start = time.monotonic()
        self._drawn_at = 0.0
        self._drawn = False

    def advance(self, objects: int, nbytes: int = 0) -> None:
        self.objects += objects
        self.nbytes += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._drawn_at >= _REDRAW_S:
            self._drawn_at = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled and (self._drawn or self.objects):
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        done = f"{self.objects}"
        if self.total:
            width = 24
            filled = min(width, width * self.objects // self.total)
            done = f"[{'#' * filled}{'.' * (width - filled)}] {self.objects}/{self.total}"
        rate = f"{self.objects / elapsed:,.0f} obj/s"
        if self.nbytes:
            rate += f", {_human_bytes(self.nbytes)} at {_human_bytes(self.nbytes / elapsed)}/s"
        self.stream.write(f"\r{self.label}: {done} ({rate})\x1b[K")
        self.stream.flush()
        self._drawn = True


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
