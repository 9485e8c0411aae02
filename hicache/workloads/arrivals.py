"""When requests reach the serving loop: Poisson arrival times, a queue ordered by arrival, and
open-loop replay of a trace.

The closed-loop chat (:class:`~hicache.workloads.synthetic.MultiTurnChat`) queues its turns here
too; what its prompts are is :mod:`hicache.workloads.synthetic`' concern.
"""

from __future__ import annotations

import heapq

import numpy as np

from hicache.serving.request import ServeRequest
from hicache.workloads.traces import TraceRequest

__all__ = ["ArrivalQueue", "TraceReplay", "poisson_times"]


def poisson_times(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """``n`` arrival times (seconds) of a Poisson process at ``rate`` per second; all 0 when
    ``rate`` is 0 (everything arrives at once). Draws from ``rng`` only when ``rate > 0``."""
    if rate <= 0:
        return [0.0] * n
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate, size=n))]


class ArrivalQueue:
    """Requests ordered by arrival time; ties leave in the order they were pushed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, ServeRequest]] = []
        self._seq = 0  # breaks ties, so two requests are never compared

    def push(self, request: ServeRequest) -> None:
        heapq.heappush(self._heap, (request.arrival_s, self._seq, request))
        self._seq += 1

    def due(self, now: float) -> list[ServeRequest]:
        """Pop every request that has arrived by ``now``."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def next_arrival(self) -> float | None:
        return self._heap[0][0] if self._heap else None


class TraceReplay:
    """Open-loop replay of trace requests (read from JSONL or generated).

    Each request arrives at its Poisson time (all at once with ``rate`` 0) with its prompt as
    given and asks for ``len(output_tokens)`` tokens (at least one); an empty namespace is the
    default namespace. A text prompt left untokenized (see
    :func:`~hicache.models.hf.tokenizer.tokenize_trace`) fails when it arrives.
    """

    def __init__(self, requests: list[TraceRequest], rate: float = 0.0, seed: int = 0) -> None:
        times = poisson_times(len(requests), rate, np.random.default_rng(seed))
        self._queue = ArrivalQueue()
        for req, at in zip(requests, times, strict=True):
            namespace = req.namespace or None
            out = max(1, len(req.output_tokens))
            request = ServeRequest(req.id, list(req.tokens), out, namespace, at)
            if req.text is not None and not req.tokens:  # nothing tokenized it
                request.refusal = (
                    "a text prompt needs a tokenizer (the model has no tokenizer.json)"
                )
            self._queue.push(request)

    def due(self, now: float) -> list[ServeRequest]:
        return self._queue.due(now)

    def finished(self, request: ServeRequest, now: float) -> None:
        return None  # open loop: nothing follows from an answer

    def next_arrival(self) -> float | None:
        return self._queue.next_arrival()
