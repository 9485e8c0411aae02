"""What the serving engine and a model exchange: the model it runs (:class:`ServingModel`), one
request's chunk of a step (:class:`ChunkInput`), the per-layer wait for loads, and where a
step's batched DSA decode rows read their latent (:class:`DecodePages`, :class:`DecodeRows`).

Nothing here computes: every model (:mod:`hicache.models.tiny`, the checkpoint architectures of
:mod:`hicache.models.hf`), the engine, HiSparse and the tiering tests import these types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache.models.config import ModelConfig
from hicache.pools.device import DevicePool

__all__ = ["ChunkInput", "DecodePages", "DecodeRows", "LayerWait", "ServingModel"]

LayerWait = Callable[[str, int], None]  # (pool, layer in pool): wait until loaded


@dataclass(slots=True)
class ChunkInput:
    """New tokens of one request at positions ``start ...``, and the slots of every position
    from 0 through the last new one (the cached prefix's, then the new tokens').

    The extra pools, for models that have them: ``pool_slots`` gives each extra per-token pool
    (``swa``) its slots of positions ``0 .. start + n - 1``, -1 where the pool holds nothing (a
    window layer reads only its window, and a -1 there is an error); ``state_slot`` is the
    request's working slot in the state pools (``conv``, and ``ssm`` on the same index), holding
    the state after ``start`` tokens (ignored when ``start`` is 0: the state starts at zeros) and
    left holding the state after ``start + n``; ``state_from``, when set, is the slot to read
    the state after ``start`` tokens from instead (a cached snapshot: read per layer, after any
    load into it); ``snapshots`` maps a position ``p`` in ``start .. start + n`` to a state slot
    that receives the state after ``p`` tokens.

    HiSparse (a DSA decode token, ``hot_row`` set): ``slots`` are the request's slots in the hot
    buffer's indexer pool, and its latent is reached through its row of the hot buffer.
    """

    tokens: torch.Tensor  # (n,) int64
    start: int
    slots: torch.Tensor  # (start + n,) int64 device slots
    pool_slots: dict[str, torch.Tensor] = field(default_factory=dict)
    state_slot: int | None = None
    snapshots: dict[int, int] = field(default_factory=dict)
    state_from: int | None = None
    hot_row: int | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def new_slots(self) -> torch.Tensor:
        """The new tokens' slots (n,)."""
        return self.slots[self.start :]

    @property
    def positions(self) -> torch.Tensor:
        """The new tokens' positions (n,), on the slots' device."""
        return torch.arange(self.start, self.end, device=self.slots.device)

    def to(self, device: torch.device) -> ChunkInput:
        """The chunk with its tokens and slots on ``device``."""
        pool_slots = {name: s.to(device) for name, s in self.pool_slots.items()}
        return dataclasses.replace(
            self, tokens=self.tokens.to(device), slots=self.slots.to(device), pool_slots=pool_slots
        )


@dataclass(slots=True)
class DecodeRows:
    """The one-token chunks of a step that read their latent from one place, as tensors built
    once per step: which chunks they are, their token's row in the step's hidden states, the
    new token's position, the slots of every position up to it (padded with slot 0), and
    their hot buffer rows (HiSparse)."""

    chunks: list[int]
    token_rows: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,)
    slots: torch.Tensor  # (B, T)
    hot_rows: torch.Tensor | None = None  # (B,)

    @property
    def new_slots(self) -> torch.Tensor:
        return self.slots.gather(1, self.positions[:, None])[:, 0]


class DecodePages(Protocol):
    """Where batched decode rows keep their cached state: indexer keys by slot (``index``, a
    ``(1, layers, slots, item)`` uint8 tensor, read at the rows' ``slots``), and their latent,
    reached by page."""

    @property
    def index(self) -> torch.Tensor: ...

    def gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> torch.Tensor:
        """Store each row's new latent (``latent_new``: (B, n x item), its last ``n`` positions
        up to ``rows.positions``: dsa a token's, n = 1; dsv4 a C4 entry's 4 slots where the
        token completes a group, else n = 0), then return the latent of the tokens of the
        pages ``top`` (B, K) names, (B, K * page_size, item) in the pool dtype (anything where
        ``top`` is -1)."""
        ...

    def start_gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """:meth:`gather` begun: the returned callable gives its result once the copies it
        needs have landed (the caller computes meanwhile)."""
        ...


class ServingModel(Protocol):
    """What the serving engine runs: the seeded model (:mod:`hicache.models.tiny`) or a
    checkpoint's (:mod:`hicache.models.hf`). ``config`` names the pools it reads and writes."""

    config: ModelConfig
    device: torch.device  # where its pools are allocated

    def forward_batch(
        self,
        chunks: Sequence[ChunkInput],
        pools: Mapping[str, DevicePool],
        wait: LayerWait | None = None,
        hot: DecodePages | None = None,
    ) -> list[torch.Tensor]: ...
