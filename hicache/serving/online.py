"""Requests that arrive while the engine runs (the HTTP endpoint's), and what each waits on.

:class:`OnlineSource` is a :class:`~hicache.serving.engine_config.RequestSource` that stays open
until :meth:`OnlineSource.close`: the engine's loop waits on its ``wake`` event instead of
ending when nothing is queued. Each submitted request gets an :class:`Admission` whose future
resolves when the engine is done with it (finished or failed) and whose queue carries every
token as it is sampled, for streaming.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.errors import HiCacheError
from hicache.serving.request import ServeRequest

__all__ = ["Admission", "OnlineSource", "RequestOptions", "SourceClosedError"]


class SourceClosedError(HiCacheError):
    """The server is shutting down: it takes no new requests."""


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How a submitted request draws its tokens and whose cache it uses."""

    top_p: float = 1.0
    seed: int | None = None  # its own seed for its draws (None: the engine's)
    priority: int = 0
    namespace: str | None = None  # the cache namespace it reads and fills (None: the shared one)
    tenant: str | None = None  # who sent it: tenants take turns at admission


@dataclass(eq=False, slots=True)
class Admission:
    """One submitted request: its tokens as they come (None ends them), and its end."""

    request: ServeRequest
    done: asyncio.Future[ServeRequest]
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)


class OnlineSource:
    """Requests pushed by callers on the engine's event loop, served in arrival order."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock  # the engine's: arrival times are on its scale
        self._pending: list[ServeRequest] = []
        self._admissions: dict[int, Admission] = {}  # by id(request)
        self._ids = itertools.count()
        self.wake = asyncio.Event()  # set when a request arrives or the source closes
        self.closed = False

    def submit(
        self,
        prompt: list[int],
        max_new_tokens: int,
        temperature: float | None = None,
        options: RequestOptions | None = None,
    ) -> Admission:
        """Queue a request; raises :class:`SourceClosedError` once :meth:`close` was called."""
        if self.closed:
            raise SourceClosedError("the server is shutting down and takes no new requests")
        rid = f"http-{next(self._ids)}"
        request = ServeRequest(rid, prompt, max_new_tokens, arrival_s=self._clock())
        options = options or RequestOptions()
        request.namespace = options.namespace
        request.temperature = temperature
        request.top_p, request.seed = options.top_p, options.seed
        request.priority, request.tenant = options.priority, options.tenant
        admission = Admission(request, asyncio.get_running_loop().create_future())
        request.on_token = admission.tokens.put_nowait
        self._admissions[id(request)] = admission
        self._pending.append(request)
        self.wake.set()
        return admission

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet done."""
        return len(self._admissions)

    def cancel(self, admission: Admission) -> None:
        """Its client went away: the engine drops the request at its next round (a
        "cancelled" error); nothing if it is done already."""
        if id(admission.request) in self._admissions:
            admission.request.cancelled = True
            self.wake.set()

    def close(self) -> None:
        """Take no more requests; the engine ends once those in flight are done."""
        self.closed = True
        self.wake.set()

    # ----- the RequestSource side, called by the engine ----------------------------------
    def due(self, now: float) -> list[ServeRequest]:
        out, self._pending = self._pending, []
        return out

    def finished(self, request: ServeRequest, now: float) -> None:
        admission = self._admissions.pop(id(request), None)
        if admission is None:
            return
        admission.tokens.put_nowait(None)
        if not admission.done.done():
            admission.done.set_result(request)

    def next_arrival(self) -> float | None:
        """None once closed with nothing pending (the engine may end), else "not yet known"."""
        if self._pending:
            return self._clock()
        return None if self.closed else float("inf")
