"""Request sources for the serving loop: closed-loop multi-turn chat and trace replay.

Multi-turn chat: ``clients`` conversations of ``rounds`` turns each. Round 1 of every client
arrives at its Poisson arrival time; each later round arrives when the client's previous answer
is complete, and its prompt is the previous prompt, the answer the model actually generated and a
new user turn, so the cache sees the growing histories real chats produce. Clients share one of a
few system prompts and are spread over tenant namespaces.

Trace replay (and the few-shot and long-document generators): each request arrives at its
Poisson time (or all at once with rate 0), prompts as given; ``output_tokens`` gives the length.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from hicache.errors import InvalidArgumentError
from hicache.serving.request import ServeRequest
from hicache.serving.traces import TraceRequest

__all__ = [
    "ChatConfig",
    "MultiTurnChat",
    "SharedPrefixConfig",
    "TraceReplay",
    "shared_prefix_trace",
]


@dataclass(frozen=True, slots=True)
class ChatConfig:
    clients: int = 12
    rounds: int = 4
    system_tokens: int = 256
    system_prompts: int = 2
    turn_tokens: int = 64
    output_tokens: int = 16
    tenants: int = 1
    rate: float = 0.0  # round-1 arrivals per second (Poisson); 0: all at once
    barrier: bool = True  # round r+1 starts once every client has its round-r answer
    seed: int = 0
    vocab: int = 32000

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "system_prompts", "turn_tokens", "output_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"chat {name} must be positive")
        if self.system_tokens < 0 or self.tenants <= 0 or self.rate < 0:
            raise InvalidArgumentError("system_tokens >= 0, tenants > 0 and rate >= 0 please")

    def working_set_tokens(self) -> int:
        """Tokens of every client's final history: what an infinite cache would hold."""
        per_round = self.turn_tokens + self.output_tokens
        return self.clients * (self.system_tokens + self.rounds * per_round)


def _poisson_times(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    if rate <= 0:
        return [0.0] * n
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate, size=n))]


class _Queue:
    """Requests by arrival time."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, ServeRequest]] = []
        self._seq = 0

    def push(self, request: ServeRequest) -> None:
        heapq.heappush(self._heap, (request.arrival_s, self._seq, request))
        self._seq += 1

    def due(self, now: float) -> list[ServeRequest]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def next_arrival(self) -> float | None:
        return self._heap[0][0] if self._heap else None


class MultiTurnChat:
    """Closed-loop chat clients (see the module docstring)."""

    def __init__(self, config: ChatConfig) -> None:
        self.config = config
        rng = np.random.default_rng(config.seed)
        systems = [self._draw(rng, config.system_tokens) for _ in range(config.system_prompts)]
        # One stream per client: its turns do not depend on the order in which others finish,
        # so every cache configuration is sent the same prompts.
        self._client_rngs = [np.random.default_rng((config.seed, c)) for c in range(config.clients)]
        self._queue = _Queue()
        self._held: dict[int, list[ServeRequest]] = {}  # round -> next turns behind the barrier
        self._open = {0: config.clients}  # round -> clients still in it
        times = _poisson_times(config.clients, config.rate, rng)
        for client in range(config.clients):
            history = list(systems[client % config.system_prompts])
            self._queue.push(self._turn(client, 0, history, times[client]))

    def _draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, self.config.vocab, size=n)]

    def _turn(self, client: int, round_: int, history: list[int], at: float) -> ServeRequest:
        prompt = history + self._draw(self._client_rngs[client], self.config.turn_tokens)
        tenant = f"tenant-{client % self.config.tenants}" if self.config.tenants > 1 else None
        return ServeRequest(
            f"c{client}-r{round_}", prompt, self.config.output_tokens, tenant, at, (client, round_)
        )

    def due(self, now: float) -> list[ServeRequest]:
        return self._queue.due(now)

    def finished(self, request: ServeRequest, now: float) -> None:
        """The answer to a turn arrived (or the turn failed: ``generated`` is empty)."""
        client, round_ = request.client
        nxt = None
        if round_ + 1 < self.config.rounds and request.generated:
            nxt = self._turn(client, round_ + 1, request.prompt + request.generated, now)
        if not self.config.barrier:
            if nxt is not None:
                self._queue.push(nxt)
            return
        if nxt is not None:
            self._held.setdefault(round_ + 1, []).append(nxt)
        self._open[round_] -= 1
        if self._open[round_] == 0:  # the whole round answered: release the next one
            released = sorted(self._held.pop(round_ + 1, []), key=lambda r: r.client)
            self._open[round_ + 1] = len(released)
            for turn in released:
                turn.arrival_s = now
                turn.record.arrival_s = now
                self._queue.push(turn)

    def next_arrival(self) -> float | None:
        return self._queue.next_arrival()


class TraceReplay:
    """Open-loop replay of trace requests (JSONL or generated)."""

    def __init__(self, requests: list[TraceRequest], rate: float = 0.0, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        times = _poisson_times(len(requests), rate, rng)
        self._queue = _Queue()
        for req, at in zip(requests, times, strict=True):
            namespace = req.namespace or None
            out = max(1, len(req.output_tokens))
            self._queue.push(ServeRequest(req.id, list(req.tokens), out, namespace, at))

    def due(self, now: float) -> list[ServeRequest]:
        return self._queue.due(now)

    def finished(self, request: ServeRequest, now: float) -> None:
        return None

    def next_arrival(self) -> float | None:
        return self._queue.next_arrival()


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    """Few-shot prompts (a few shared templates) or long documents asked several questions:
    ``requests`` prompts, each one of ``prefixes`` shared prefixes and a question of its own."""

    requests: int = 160
    prefixes: int = 8
    prefix_tokens: int = 1024
    question_tokens: int = 64
    output_tokens: int = 2
    tenants: int = 1
    seed: int = 0
    vocab: int = 32000

    def __post_init__(self) -> None:
        for name in ("requests", "prefixes", "prefix_tokens", "question_tokens", "tenants"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be positive")


def shared_prefix_trace(config: SharedPrefixConfig) -> list[TraceRequest]:
    """Requests that each pick a shared prefix at random and add a question (deterministic)."""
    rng = np.random.default_rng(config.seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, config.vocab, size=n)]

    prefixes = [draw(config.prefix_tokens) for _ in range(config.prefixes)]
    out = []
    for i in range(config.requests):
        which = int(rng.integers(0, config.prefixes))
        tenant = f"tenant-{which % config.tenants}" if config.tenants > 1 else ""
        prompt = prefixes[which] + draw(config.question_tokens)
        out.append(TraceRequest(f"p{which}-q{i}", tenant, prompt, draw(config.output_tokens)))
    return out
