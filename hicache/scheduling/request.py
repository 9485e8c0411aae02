"""What the scheduler and the prefix hold read from a waiting request.

A protocol, so the serving loop's own request fits as it is; :class:`WaitingRequest` is the plain
one for tests, tools and trace replay.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from hicache.keys import RadixKey

__all__ = ["SchedulableRequest", "WaitingRequest"]


class SchedulableRequest(Protocol):
    """What the scheduler reads from a waiting request; the serving loop's request fits.

    ``key`` is the part of the prompt that may be reused (usually the prompt less its last
    token, which must be computed to produce logits). ``arrival_time`` is on the delayer's clock.
    """

    @property
    def rid(self) -> Hashable: ...
    @property
    def key(self) -> RadixKey: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...


@dataclass(frozen=True, slots=True)
class WaitingRequest:
    """A plain :class:`SchedulableRequest`, for tests, tools and trace replay."""

    rid: Hashable
    key: RadixKey
    max_new_tokens: int = 128
    arrival_time: float = 0.0
