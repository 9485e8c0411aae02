"""Synthetic workloads, seeded and deterministic: multi-turn chat and shared-prefix prompts.

Each family builds its prompts with one piece of code, whether it becomes an open-loop trace
(``hicache bench radix``, JSONL files, :class:`~hicache.workloads.arrivals.TraceReplay`) or feeds
the serving loop as a closed loop.

**Multi-turn chat** (:class:`ChatConfig`): ``clients`` conversations of ``rounds`` turns. Client
``c`` opens with system prompt ``c mod system_prompts``; each turn's prompt is the client's
history (system prompt, earlier turns and answers) followed by a new user turn.

- :func:`multiturn_trace` (open loop): answers are drawn tokens, requests are interleaved round
  by round (round 0 of every client, then round 1, ...), and everything comes from one stream.
- :func:`burst_conversations_trace` (open loop): long conversations (contexts of 2k-8k tokens
  with :data:`BURST_CHAT`) whose every turn is in the trace; replayed at rate 0, they arrive
  together, and a turn's prompt holds the previous turn's prompt, as a restart's backlog does.
- :class:`MultiTurnChat` (closed loop): a turn's answer is what the model generated. Round 0
  arrives at Poisson times; each later turn when the client's previous answer is complete (with
  ``barrier``, once the whole previous round is). Each client draws its turns from a stream of
  its own, so its prompts do not depend on the order in which clients finish.

**Shared prefix** (:class:`SharedPrefixConfig`, :func:`shared_prefix_trace`): ``requests``
prompts, each one of ``prefixes`` shared prefixes (few-shot templates, long documents) and a
question of its own.

Token counts are a fixed ``int`` or an inclusive range ``(lo, hi)`` drawn uniformly per span. A
fixed count draws nothing, so a fixed-size workload's stream holds token ids only. numpy's PCG64
stream is the same on every platform, so a figure can be reproduced from its command line.

:class:`WorkloadConfig` names the presets of ``hicache bench radix`` (multiturn, fewshot,
longdoc), with token counts shaped like chat traffic; :func:`generate_trace` builds them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hicache.errors import InvalidArgumentError
from hicache.serving.request import ServeRequest
from hicache.workloads.arrivals import ArrivalQueue, poisson_times
from hicache.workloads.traces import TOKEN_LIMIT, TraceRequest

__all__ = [
    "BURST_CHAT",
    "ChatConfig",
    "MultiTurnChat",
    "SharedPrefixConfig",
    "TenantSpread",
    "TokenCount",
    "WorkloadConfig",
    "WorkloadKind",
    "burst_conversations_trace",
    "generate_trace",
    "multiturn_trace",
    "shared_prefix_trace",
    "tenant_name",
]

TokenCount = int | tuple[int, int]  # a fixed count, or an inclusive range drawn uniformly


# ----- checks and draws -----------------------------------------------------------------------
def _check_ints(owner: object, names: tuple[str, ...], minimum: int) -> None:
    for name in names:
        value = getattr(owner, name)
        if type(value) is not int or value < minimum:
            raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_counts(owner: object, names: tuple[str, ...], minimum: int) -> None:
    for name in names:
        value = getattr(owner, name)
        bounds = (value, value) if type(value) is int else value
        fits = type(bounds) is tuple and len(bounds) == 2 and all(type(b) is int for b in bounds)
        if not fits or not minimum <= bounds[0] <= bounds[1]:
            raise InvalidArgumentError(
                f"{name} must be an int >= {minimum} or a range (lo, hi) with {minimum} <= lo <= "
                f"hi, got {value!r}"
            )


def _check_vocab(vocab: object) -> None:
    if type(vocab) is not int or not 0 < vocab <= TOKEN_LIMIT:
        raise InvalidArgumentError(f"vocab must be an int in [1, 2**32], got {vocab!r}")


class _TokenDraw:
    """Token ids, token counts and choices from one seeded stream."""

    def __init__(self, seed: int | tuple[int, int], vocab: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab

    def count(self, n: TokenCount) -> int:
        if isinstance(n, int):
            return n  # a fixed count draws nothing: the stream then holds token ids only
        return int(self._rng.integers(n[0], n[1] + 1))

    def tokens(self, n: TokenCount) -> list[int]:
        ids: list[int] = self._rng.integers(0, self._vocab, size=self.count(n)).tolist()
        return ids

    def index(self, n: int) -> int:
        return int(self._rng.integers(0, n))

    def arrival_times(self, n: int, rate: float) -> list[float]:
        return poisson_times(n, rate, self._rng)


def tenant_name(index: int, tenants: int) -> str:
    """The namespace of tenant ``index mod tenants``; ``""`` (the default) for one tenant."""
    return f"tenant-{index % tenants}" if tenants > 1 else ""


# ----- multi-turn chat ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ChatConfig:
    """A multi-turn chat; ``rate`` and ``barrier`` shape the closed loop's arrivals only."""

    clients: int = 12
    rounds: int = 4
    system_tokens: TokenCount = 256
    system_prompts: int = 2
    turn_tokens: TokenCount = 64
    output_tokens: TokenCount = 16  # per turn: drawn answer (trace) or max_new_tokens (loop)
    tenants: int = 1  # client c is in namespace tenant_name(c, tenants)
    rate: float = 0.0  # round-0 arrivals per second (Poisson); 0: all at once
    barrier: bool = True  # round r+1 starts once every client has its round-r answer
    seed: int = 0
    vocab: int = 32000

    def __post_init__(self) -> None:
        _check_ints(self, ("clients", "rounds", "system_prompts", "tenants"), 1)
        _check_counts(self, ("turn_tokens", "output_tokens"), 1)
        _check_counts(self, ("system_tokens",), 0)
        _check_vocab(self.vocab)
        if not self.rate >= 0:
            raise InvalidArgumentError(f"rate must be >= 0, got {self.rate!r}")


class _ChatPrompts:
    """The prompt-building half of a chat, shared by the trace and the closed loop."""

    def __init__(self, config: ChatConfig, draw: _TokenDraw) -> None:
        self.config = config
        self.systems = [draw.tokens(config.system_tokens) for _ in range(config.system_prompts)]

    def opening(self, client: int) -> list[int]:
        """The history ``client`` starts from: its system prompt."""
        return list(self.systems[client % len(self.systems)])

    def turn(self, history: list[int], draw: _TokenDraw) -> list[int]:
        """The next prompt: ``history`` and a new user turn drawn from ``draw``."""
        return history + draw.tokens(self.config.turn_tokens)

    def tenant(self, client: int) -> str:
        return tenant_name(client, self.config.tenants)

    @staticmethod
    def rid(client: int, round_: int) -> str:
        return f"c{client}-r{round_}"  # ``hicache serve`` reads the round back from ``-r``


def multiturn_trace(config: ChatConfig) -> list[TraceRequest]:
    """The chat as an open-loop trace of ``clients * rounds`` requests (see the module doc)."""
    draw = _TokenDraw(config.seed, config.vocab)
    prompts = _ChatPrompts(config, draw)
    histories = [prompts.opening(c) for c in range(config.clients)]
    out: list[TraceRequest] = []
    for r in range(config.rounds):
        for c in range(config.clients):
            prompt = prompts.turn(histories[c], draw)
            answer = draw.tokens(config.output_tokens)
            histories[c] = prompt + answer
            out.append(TraceRequest(prompts.rid(c, r), prompts.tenant(c), prompt, answer))
    return out


# Conversations of 2-2.6k tokens at their first turn and up to about 7.3k at their fourth: 1k of
# system prompt, turns of 1-1.5k and short answers, so a burst is prefill-bound.
BURST_CHAT = ChatConfig(
    clients=8, rounds=4, system_tokens=1024, system_prompts=2, turn_tokens=(1024, 1536),
    output_tokens=2,
)  # fmt: skip


def burst_conversations_trace(config: ChatConfig = BURST_CHAT) -> list[TraceRequest]:
    """Every turn of ``config``'s conversations, to replay as one burst (``rate`` 0).

    Turn ``r`` of a conversation holds turn ``r - 1``'s prompt and its answer, and turns go
    round by round as :func:`multiturn_trace` makes them, so a scheduler that admits requests in
    arrival order starts several turns of one conversation at once: they all compute the
    shared history unless the later ones wait for the earlier one to cache it.
    """
    return multiturn_trace(config)


class MultiTurnChat:
    """The chat as closed-loop clients of the serving loop (see the module docstring)."""

    def __init__(self, config: ChatConfig) -> None:
        self.config = config
        draw = _TokenDraw(config.seed, config.vocab)
        self._prompts = _ChatPrompts(config, draw)
        self._client_draws = [
            _TokenDraw((config.seed, c), config.vocab) for c in range(config.clients)
        ]
        self._queue = ArrivalQueue()
        self._held: dict[int, list[ServeRequest]] = {}  # round -> next turns behind the barrier
        self._open = {0: config.clients}  # round -> clients still in it
        times = draw.arrival_times(config.clients, config.rate)
        for client in range(config.clients):
            opening = self._prompts.opening(client)
            self._queue.push(self._turn(client, 0, opening, times[client]))

    def _turn(self, client: int, round_: int, history: list[int], at: float) -> ServeRequest:
        draw = self._client_draws[client]
        prompt = self._prompts.turn(history, draw)
        max_new = draw.count(self.config.output_tokens)
        tenant = self._prompts.tenant(client) or None
        rid = self._prompts.rid(client, round_)
        return ServeRequest(rid, prompt, max_new, tenant, at, (client, round_))

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


# ----- shared prefixes ------------------------------------------------------------------------
class TenantSpread(enum.Enum):
    """How shared-prefix requests are spread over tenant namespaces."""

    BY_PREFIX = "by_prefix"  # prefix p belongs to tenant p: tenants never cache the same prefix
    PER_REQUEST = "per_request"  # a random tenant per request: each caches its own copy


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    """Few-shot prompts (a few shared templates) or long documents asked several questions:
    ``requests`` prompts, each one of ``prefixes`` shared prefixes and a question of its own."""

    requests: int = 160
    prefixes: int = 8
    prefix_tokens: TokenCount = 1024
    question_tokens: TokenCount = 64
    output_tokens: TokenCount = 2
    tenants: int = 1
    spread: TenantSpread = TenantSpread.BY_PREFIX
    seed: int = 0
    vocab: int = 32000

    def __post_init__(self) -> None:
        _check_ints(self, ("requests", "prefixes", "tenants"), 1)
        _check_counts(self, ("prefix_tokens", "question_tokens"), 1)
        _check_counts(self, ("output_tokens",), 0)
        _check_vocab(self.vocab)
        if not isinstance(self.spread, TenantSpread):
            raise InvalidArgumentError(f"spread must be a TenantSpread, got {self.spread!r}")


def shared_prefix_trace(config: SharedPrefixConfig) -> list[TraceRequest]:
    """Requests that each pick a shared prefix at random and add a question (deterministic)."""
    draw = _TokenDraw(config.seed, config.vocab)
    prefixes = [draw.tokens(config.prefix_tokens) for _ in range(config.prefixes)]
    out: list[TraceRequest] = []
    for i in range(config.requests):
        which = draw.index(config.prefixes)
        if config.spread is TenantSpread.PER_REQUEST:
            tenant = tenant_name(draw.index(config.tenants), config.tenants)
        else:
            tenant = tenant_name(which, config.tenants)
        prompt = prefixes[which] + draw.tokens(config.question_tokens)
        out.append(
            TraceRequest(f"p{which}-q{i}", tenant, prompt, draw.tokens(config.output_tokens))
        )
    return out


# ----- the presets of ``hicache bench radix`` -------------------------------------------------
class WorkloadKind(enum.Enum):
    MULTITURN = "multiturn"  # 4 system prompts of 250-350 tokens, turns of 50-200, answers 100-300
    FEWSHOT = "fewshot"  # clients // 16 templates of 1000-3000 tokens, questions of 20-100
    LONGDOC = "longdoc"  # clients // 8 documents of 4000-8000 tokens, questions of 20-100


# Shared-prefix presets: (clients per prefix, prefix tokens, answer tokens).
_SHARED_PRESETS: dict[WorkloadKind, tuple[int, TokenCount, TokenCount]] = {
    WorkloadKind.FEWSHOT: (16, (1000, 3000), (10, 100)),
    WorkloadKind.LONGDOC: (8, (4000, 8000), (50, 200)),
}


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """A preset trace of ``clients x rounds`` requests over ``namespaces`` tenants."""

    kind: WorkloadKind = WorkloadKind.MULTITURN
    clients: int = 64
    rounds: int = 5
    seed: int = 0
    namespaces: int = 2
    vocab: int = 32000

    def __post_init__(self) -> None:
        if not isinstance(self.kind, WorkloadKind):
            raise InvalidArgumentError("kind must be a WorkloadKind")
        _check_ints(self, ("clients", "rounds", "namespaces"), 1)
        _check_vocab(self.vocab)

    def generator_config(self) -> ChatConfig | SharedPrefixConfig:
        """The generator's config this preset stands for."""
        if self.kind is WorkloadKind.MULTITURN:
            return ChatConfig(
                clients=self.clients, rounds=self.rounds, system_tokens=(250, 350),
                system_prompts=4, turn_tokens=(50, 200), output_tokens=(100, 300),
                tenants=self.namespaces, seed=self.seed, vocab=self.vocab,
            )  # fmt: skip
        per_prefix, prefix_tokens, output_tokens = _SHARED_PRESETS[self.kind]
        return SharedPrefixConfig(
            requests=self.clients * self.rounds, prefixes=max(1, self.clients // per_prefix),
            prefix_tokens=prefix_tokens, question_tokens=(20, 100), output_tokens=output_tokens,
            tenants=self.namespaces, spread=TenantSpread.PER_REQUEST, seed=self.seed,
            vocab=self.vocab,
        )  # fmt: skip


def generate_trace(config: WorkloadConfig) -> list[TraceRequest]:
    """The preset trace of ``config.clients * config.rounds`` requests."""
    generator = config.generator_config()
    if isinstance(generator, ChatConfig):
        return multiturn_trace(generator)
    return shared_prefix_trace(generator)
