"""The request-to-token table: for each running request, the slots of its tokens' KV."""

from __future__ import annotations

import torch

from hicache.errors import DoubleFreeError, InvalidArgumentError

__all__ = ["ReqToTokenPool"]


class ReqToTokenPool:
    """``max_requests`` rows of ``max_context_len`` slot indices (int64, CPU)."""

    def __init__(self, max_requests: int, max_context_len: int) -> None:
        if max_requests <= 0 or max_context_len <= 0:
            raise InvalidArgumentError("max_requests and max_context_len must be positive")
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int64)
        self.max_context_len = max_context_len
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._in_use = [False] * max_requests

    @property
    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < len(self._in_use):
            raise InvalidArgumentError(f"request row {row} out of range")
        if not self._in_use[row]:
            raise DoubleFreeError(f"request row {row} is already free")
        self._in_use[row] = False
        self._free_rows.append(row)
