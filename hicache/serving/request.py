"""A serving request and the record the engine keeps of it."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.keys import RadixKey
from hicache.radix.lifecycle import CachedRequest
from hicache.radix.tier_peek import TierPeek

__all__ = ["RequestRecord", "RequestState", "ServeRequest", "StepRecord"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times in seconds from the start of the run."""

    rid: str
    arrival_s: float
    prompt_tokens: int
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    hit_device: int = 0
    hit_host: int = 0
    hit_l3: int = 0
    computed_tokens: int = 0
    held_rounds: int = 0  # admission rounds it waited for a prefix another request computed
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: its wall time, and the tokens it computed."""

    seconds: float
    prefill_tokens: int  # prompt tokens, in chunks of the requests still prefilling
    decode_tokens: int  # one per request that decoded


@dataclass(eq=False)
class ServeRequest:
    """A prompt to serve: ``max_new_tokens`` tokens are generated after it."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    namespace: str | None = None
    arrival_s: float = 0.0
    client: Any = None  # the workload's handle, to make the next turn
    state: RequestState = RequestState.WAITING
    generated: list[int] = field(default_factory=list)
    cached: CachedRequest | None = None
    prefix_match: TierPeek | None = None  # this round's peek of its prefix (see engine_admission)
    pending_loads: list[Any] = field(default_factory=list)
    pool_state: Any = None  # its slots in the model's extra pools (a PoolRequest), once running
    hot: Any = None  # HiSparse: what it holds of the hot buffer (a HotRequest), once admitted
    cached_at_submit: int = 1 << 62  # device + host tokens when last checked for a prefetch
    had_turn: bool = False  # was next to run: what L3 held beyond its host room was read then
    read_ahead: bool = False  # that read was tried once already, during the step before its turn
    temperature: float | None = None  # None: the engine's
    top_p: float = 1.0  # nucleus sampling: 1 keeps every token
    seed: int | None = None  # the request's own seed for its draws (None: the engine's)
    priority: int = 0  # admitted before lower ones; its pages evicted after theirs (priority)
    tenant: str | None = None  # whose share of the engine it takes (fair admission)
    on_token: Callable[[int], None] | None = None  # told of each token as it is sampled
    cancelled: bool = False  # its client went away: dropped between steps
    refusal: str | None = None  # why it cannot be served, known before it arrives
    record: RequestRecord = field(init=False)
    _key: RadixKey | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.record = RequestRecord(self.rid, self.arrival_s, len(self.prompt))

    # SchedulableRequest: the reusable part of the prompt (the last token is always computed).
    @property
    def key(self) -> RadixKey:
        if self._key is None:
            self._key = RadixKey(_packed(self.prompt[:-1]), self.namespace)
        return self._key

    @property
    def arrival_time(self) -> float:
        return self.arrival_s

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.generated


def _packed(tokens: list[int]) -> Sequence[int]:
    """``tokens`` as 32-bit words when they fit: the tree packs a key of them with one copy
    instead of a conversion per token, and the scheduler packs every waiting request's key each
    round. Ids that do not fit stay a list, for the tree to refuse with its own error."""
    words = array("I")
    try:
        words.fromlist(tokens)
    except (OverflowError, TypeError):
        return tokens
    return words
