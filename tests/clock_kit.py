"""A clock the test sets by hand, for the parts that take a ``clock`` callable (the radix tree,
the tiered cache, the prefill delayer, the per-caller limits)."""

from __future__ import annotations


class FakeClock:
    """Seconds as the test says: ``now`` is read by a call and moved by the test."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
