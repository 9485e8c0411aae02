"""What the engine tells its observers, one typed event at a time (:meth:`Engine.observe`).

Per loop round: :class:`AdmissionRound` before admission looks at the queue, then one
:class:`RequestAdmitted` per request it starts. Per forward step: :class:`StepStarted`, one
:class:`ChunkPlanned` per request in the batch (its chunk has its slots), one
:class:`TokenSampled` per token drawn, and a :class:`~hicache.serving.request.StepRecord` once
the step is over. An observer runs inline, on the engine's event loop, between the engine's own
actions: it sees the objects as they are at that moment, must not change them, and an error it
raises ends the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from hicache.models.types import ChunkInput
    from hicache.serving.request import ServeRequest

__all__ = [
    "AdmissionRound",
    "ChunkPlanned",
    "EngineObservers",
    "RequestAdmitted",
    "StepStarted",
    "TokenSampled",
]

E = TypeVar("E")


@dataclass(frozen=True, slots=True)
class AdmissionRound:
    """A round of admission begins: ``waiting`` requests queued, ``running`` in the batch."""

    waiting: int
    running: int


@dataclass(frozen=True, slots=True)
class RequestAdmitted:
    """``request`` took its cached prefix and its slots: it runs from the next step."""

    request: ServeRequest


@dataclass(frozen=True, slots=True)
class StepStarted:
    """A forward step begins over the ``running`` requests of the batch."""

    running: int


@dataclass(frozen=True, slots=True)
class ChunkPlanned:
    """``chunk`` of ``request`` has its slots, every pool's, and goes into this step."""

    request: ServeRequest
    chunk: ChunkInput


@dataclass(frozen=True, slots=True)
class TokenSampled:
    """``token`` was drawn from ``logits`` as output ``position`` of ``request``."""

    request: ServeRequest
    position: int
    logits: torch.Tensor
    token: int


class EngineObservers:
    """The callbacks registered for each kind of event, called in registration order."""

    def __init__(self) -> None:
        self._by_kind: dict[type[Any], list[Callable[[Any], None]]] = {}

    def add(self, callback: Callable[[E], None], kind: type[E]) -> None:
        self._by_kind.setdefault(kind, []).append(callback)

    def tell(self, event: object) -> None:
        for callback in self._by_kind.get(type(event), ()):
            callback(event)
