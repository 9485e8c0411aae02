"""Which of a router's workers requests may go to: probed, retired after repeated failures,
brought back.

Every ``interval_s`` each worker's ``/health`` is asked (``probe_timeout_s``). A worker is
retired (the router sends it nothing) after ``retire_after`` failures in a row, counting failed
probes and connections the router could not make; a local worker whose process exited is
retired at once and started again, after 1 s, then twice as long after each failed start, up to
``max_backoff_s``. A retired worker is probed like the others and brought back after
``readmit_after`` answers in a row. Nothing here stops the router: with no worker healthy it
answers 503 with Retry-After until one is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from hicache.errors import ConfigError
from hicache.scheduling.router import CacheAwareRouter
from hicache.server.workers import Worker, WorkerStartError

__all__ = ["HealthRules", "WorkerHealth"]

logger = logging.getLogger(__name__)

Probe = Callable[[Worker], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class HealthRules:
    interval_s: float = 0.5
    probe_timeout_s: float = 2.0
    retire_after: int = 3  # failures in a row (one slow reply is not a dead worker)
    readmit_after: int = 2  # answers in a row from a retired worker
    max_backoff_s: float = 60.0  # between starts of a local worker that keeps failing

    def __post_init__(self) -> None:
        for name in ("interval_s", "probe_timeout_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.retire_after < 1 or self.readmit_after < 1:
            raise ConfigError("retire_after and readmit_after must be at least 1")


@dataclass(slots=True)
class _State:
    failures: int = 0
    answers: int = 0
    backoff_s: float = 1.0
    next_start: float = 0.0
    restarts: int = 0


@dataclass
class WorkerHealth:
    """The health of ``workers``, kept in ``tree`` (its ``alive`` workers take requests)."""

    workers: Sequence[Worker]
    tree: CacheAwareRouter
    probe: Probe
    rules: HealthRules = field(default_factory=HealthRules)
    _states: list[_State] = field(init=False)

    def __post_init__(self) -> None:
        self._states = [_State() for _ in self.workers]

    @property
    def healthy(self) -> list[int]:
        return self.tree.alive

    def restarts(self, worker: int) -> int:
        return self._states[worker].restarts

    def failed(self, worker: int, why: str) -> None:
        """A failure seen outside the probes (a connection the router could not make)."""
        state = self._states[worker]
        state.failures, state.answers = state.failures + 1, 0
        if worker in self.tree.alive and state.failures >= self.rules.retire_after:
            self._retire(worker, f"{why}, {state.failures} failures in a row")

    async def run(self) -> None:
        """Probe and supervise until cancelled."""
        while True:
            await asyncio.gather(*(self._check(w) for w in self.workers))
            await asyncio.sleep(self.rules.interval_s)

    async def _check(self, worker: Worker) -> None:
        index, state = worker.index, self._states[worker.index]
        if not worker.alive:  # a local process that exited: no probe needed to know
            if index in self.tree.alive:
                self.tree.retire(index)
            await self._restart(worker, state)
            return
        if await self.probe(worker):
            state.failures, state.answers = 0, state.answers + 1
            if index not in self.tree.alive and state.answers >= self.rules.readmit_after:
                self.tree.readmit(index)
                state.backoff_s = 1.0
                logger.warning("worker %d answers again: requests go to it", index)
        else:
            self.failed(index, "no answer to /health in time")

    async def _restart(self, worker: Worker, state: _State) -> None:
        loop = asyncio.get_running_loop()
        if not worker.restartable or loop.time() < state.next_start:
            return
        logger.warning("worker %d %s: starting it again", worker.index, worker.ended())
        try:
            await worker.restart()
        except WorkerStartError as exc:
            logger.warning("%s; trying again in %.0f s", exc, state.backoff_s)
        else:
            state.restarts += 1
            state.failures = state.answers = 0
            logger.warning("worker %d started again (pid %s)", worker.index, worker.pid)
        state.next_start = loop.time() + state.backoff_s
        state.backoff_s = min(2 * state.backoff_s, self.rules.max_backoff_s)

    def _retire(self, worker: int, why: str) -> None:
        self.tree.retire(worker)
        logger.warning("worker %d %s: no more requests go to it until it answers again",
                       worker, why)  # fmt: skip
