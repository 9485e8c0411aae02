"""The tier's jobs in flight and their results, shared by vLLM's scheduler thread (submit,
collect, drain) and the tier's loop thread (run, finish).

No vLLM import here: results are whatever object the tier makes of a job's outcome.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

__all__ = ["JobBoard"]

R = TypeVar("R")


class JobBoard(Generic[R]):
    """Counts jobs from submit to result and queues their results.

    Every job that :meth:`begin` counted must :meth:`finish` exactly once, whatever happens to
    it; :meth:`wait_idle` returns when none is left, so a drained tier has every result queued.
    """

    def __init__(self) -> None:
        self._results: collections.deque[R] = collections.deque()  # append/popleft: thread-safe
        self._idle = threading.Condition()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def begin(self) -> None:
        with self._idle:
            self._in_flight += 1

    def finish(self, result: R) -> None:
        self._results.append(result)
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def take(self) -> list[R]:
        """The results queued since the last call, oldest first."""
        done: list[R] = []
        while self._results:
            done.append(self._results.popleft())
        return done

    def pending(self) -> bool:
        return self._in_flight > 0 or bool(self._results)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no job is in flight; False if ``timeout_s`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)
