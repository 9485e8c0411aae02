"""Supervised asyncio tasks: a background loop that fails is logged, counted and restarted.

A worker is a coroutine function run forever until it returns or the supervisor stops. An
exception from it is never lost: it is logged with its traceback, counted, and the worker is
started again after a short, growing backoff. Stopping cancels every worker and waits for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["TaskSupervisor"]

logger = logging.getLogger(__name__)

Worker = Callable[[], Awaitable[None]]


class TaskSupervisor:
    """Owns background tasks; ``on_restart`` is called once per failure (for a metric)."""

    def __init__(
        self,
        on_restart: Callable[[str, BaseException], None] | None = None,
        max_backoff_s: float = 1.0,
    ) -> None:
        self._on_restart = on_restart
        self._max_backoff_s = max_backoff_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.failures: dict[str, int] = {}

    def start(self, name: str, worker: Worker) -> None:
        if name in self._tasks and not self._tasks[name].done():
            raise RuntimeError(f"a task named {name!r} is already running")
        self._tasks[name] = asyncio.get_running_loop().create_task(
            self._run(name, worker), name=f"hicache:{name}"
        )

    async def _run(self, name: str, worker: Worker) -> None:
        backoff = 0.01
        while True:
            try:
                await worker()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures[name] = self.failures.get(name, 0) + 1
                logger.exception("hicache task %s failed; restarting it", name)
                if self._on_restart is not None:
                    self._on_restart(name, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)

    @property
    def running(self) -> list[str]:
        return [name for name, task in self._tasks.items() if not task.done()]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # pragma: no cover - _run catches everything but cancellation
                logger.exception("hicache task ended with an error while stopping")
        self._tasks.clear()
