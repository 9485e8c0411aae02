"""Warnings for failures that repeat, rate-limited.

An L3 that is down fails every call, hundreds a second under load: a warning per call would
flood the log, bury whatever else it says, and cost more than the failed calls. The metrics
count every failure; the log only needs to say that failures happen, of which kinds, and
roughly how often.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["FailureLog"]


class FailureLog:
    """Logs the first failure of each exception type at WARNING; then at most one summary
    warning per ``interval_s`` of how many more failed (and the last of them), the others
    at DEBUG only. :meth:`flush` logs the summary still owed (call it when stopping)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what  # what failed, e.g. "L3 call failed"
        self._interval_s = interval_s
        self._clock = clock
        self._seen: set[type[BaseException]] = set()
        self._unlogged = 0  # failures since the last warning, not in any warning yet
        self._last: BaseException | None = None
        self._window_start = 0.0  # when the last warning was logged

    def failed(self, exc: BaseException) -> None:
        """Note one failure; log it if it is the first of its type or a summary is due."""
        now = self._clock()
        if type(exc) not in self._seen:
            self._seen.add(type(exc))
            self._logger.warning("%s: %s: %s", self._what, type(exc).__name__, exc)
            self._window_start = now
            return
        self._logger.debug("%s: %s: %s", self._what, type(exc).__name__, exc)
        self._unlogged += 1
        self._last = exc
        if now - self._window_start >= self._interval_s:
            self.flush()

    def flush(self) -> None:
        """Log how many failures no warning has reported yet, if any."""
        if self._unlogged:
            last = self._last
            self._logger.warning(
                "%s %d more time(s) in the last %.0f s (last: %s: %s)",
                self._what,
                self._unlogged,
                self._clock() - self._window_start,
                type(last).__name__,
                last,
            )
        self._unlogged = 0
        self._last = None
        self._window_start = self._clock()
