"""A request source for two-turn conversations: a first turn, then (once it finished) a
follow-up whose prompt is the first turn's prompt, its output and a question."""

from __future__ import annotations

from hicache.serving.request import ServeRequest


class FollowUp:
    """Turn ``turn1`` generates ``first_output`` tokens; ``turn2`` then generates
    ``second_output``. Finished requests are kept in ``done`` by id; an error fails the test."""

    def __init__(
        self, prompt: list[int], question: list[int], first_output: int, second_output: int = 6
    ) -> None:
        self._pending = [ServeRequest("turn1", list(prompt), first_output)]
        self.question = question
        self.second_output = second_output
        self.done: dict[str, ServeRequest] = {}

    def due(self, now: float) -> list[ServeRequest]:
        due, self._pending = self._pending, []
        return due

    def finished(self, request: ServeRequest, now: float) -> None:
        assert request.record.error is None, request.record.error
        self.done[request.rid] = request
        if request.rid == "turn1":
            follow = request.prompt + request.generated + self.question
            self._pending = [ServeRequest("turn2", follow, self.second_output)]

    def next_arrival(self) -> float | None:
        return 0.0 if self._pending else None
