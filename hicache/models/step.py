"""The step loop every model runs: a step's chunks checked and laid out once (:class:`Step`),
then :class:`PagedDecoder`'s pre-norm decoder over them (embedding; per layer RMSNorm, token
mixing through the pools, RMSNorm, feed-forward, each added back; the final norm and each
chunk's last-token logits).

An architecture subclasses :class:`PagedDecoder` and says how a layer mixes tokens
(:meth:`PagedDecoder.mix`) and, where it is not the SwiGLU MLP, its feed-forward block. Token
mixing either runs over the whole step (paged attention batches the decode rows) or per chunk
(:meth:`Step.each`: its rows of the step's tokens, and the chunk on the model's device).
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache.errors import InvalidArgumentError
from hicache.models.attention import StepLayout
from hicache.models.config import ModelConfig
from hicache.models.layers import rms_norm, swiglu
from hicache.models.rope import Pairing, RotaryTable, Rotation, rotate
from hicache.models.types import ChunkInput, DecodePages, DecodeRows, LayerWait
from hicache.pools.device import DevicePool

__all__ = ["LayerContext", "PagedDecoder", "Step", "last_logits"]


@dataclass(slots=True)
class Step:
    """A step's chunks (on the model's device, each at ``rows`` of the step's tokens), their
    token ids concatenated, the paged attention layout, the device pools, the HiSparse hot
    buffer if any, and (when the model has one) the rotation of every token."""

    ids: torch.Tensor  # (N,)
    layout: StepLayout
    chunks: list[ChunkInput]
    rows: list[slice]
    pools: Mapping[str, DevicePool]
    hot: DecodePages | None = None
    rotation: Rotation | None = None
    _decode_groups: list[DecodeRows] | None = None

    @classmethod
    def of(
        cls,
        chunks: Sequence[ChunkInput],
        pools: Mapping[str, DevicePool],
        hot: DecodePages | None,
        vocab_size: int,
        device: torch.device,
    ) -> Step:
        """InvalidArgumentError for an empty step or chunk, or an id outside the vocabulary."""
        if not chunks or any(len(c.tokens) == 0 for c in chunks):
            raise InvalidArgumentError("a step needs chunks of at least one token")
        ids = torch.cat([c.tokens for c in chunks]).to(device)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise InvalidArgumentError(f"token ids must be in [0, {vocab_size})")
        moved = [c.to(device) for c in chunks]
        lengths = [len(c.tokens) for c in chunks]
        layout = StepLayout.of([c.start for c in moved], [c.slots for c in moved], lengths)
        bounds = [0, *itertools.accumulate(lengths)]
        rows = [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]
        return cls(ids, layout, moved, rows, pools, hot)

    def each(self) -> Iterator[tuple[slice, ChunkInput]]:
        """Each chunk with its rows in the step's tokens."""
        return zip(self.rows, self.chunks, strict=True)

    def rotation_of(self, rows: slice) -> Rotation | None:
        """The rotation of the tokens ``rows`` (one chunk's)."""
        return None if self.rotation is None else self.rotation.rows(rows)

    @property
    def decode_groups(self) -> list[DecodeRows]:
        """The step's one-token chunks, grouped by where their latent is: the anchor pools,
        or the HiSparse hot buffer (chunks with a ``hot_row``); built once per step."""
        if self._decode_groups is None:
            self._decode_groups = _decode_groups(self.chunks, self.rows)
        return self._decode_groups


def _decode_groups(chunks: Sequence[ChunkInput], rows: Sequence[slice]) -> list[DecodeRows]:
    groups: dict[bool, list[int]] = {False: [], True: []}
    for i, chunk in enumerate(chunks):
        if len(chunk.tokens) == 1:
            groups[chunk.hot_row is not None].append(i)
    out = []
    for in_hot, indices in groups.items():
        if not indices:
            continue
        picked = [chunks[i] for i in indices]
        device = picked[0].slots.device
        slots = torch.nn.utils.rnn.pad_sequence([c.slots for c in picked], batch_first=True)
        hot_rows = [c.hot_row for c in picked] if in_hot else None
        out.append(
            DecodeRows(
                indices,
                torch.tensor([rows[i].start for i in indices], device=device),
                torch.tensor([c.start for c in picked], device=device),
                slots,
                None if hot_rows is None else torch.tensor(hot_rows, dtype=torch.int64),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class LayerContext:
    """What the seeded model's layer blocks read besides their weights and the step: its
    sizes, the dtype it computes in, and its rotary tables (the heads', and DSA's decoupled
    latent key's), whose pairs are interleaved."""

    config: ModelConfig
    dtype: torch.dtype
    rotary: RotaryTable
    latent_rotary: RotaryTable

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` (..., heads, head_dim) rotated at ``positions`` (...)."""
        cos, sin = self.rotary.at(positions, self.dtype)
        return rotate(x, cos[..., None, :], sin[..., None, :], Pairing.INTERLEAVED)

    def latent_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A DSA latent's rotary part ``x`` (..., R) rotated at ``positions`` (...)."""
        cos, sin = self.latent_rotary.at(positions, self.dtype)
        return rotate(x, cos, sin, Pairing.INTERLEAVED)


def last_logits(lasts: torch.Tensor, lm_head: torch.Tensor) -> list[torch.Tensor]:
    """Each chunk's logits (vocab,) in float32 on the CPU from its last hidden state (``lasts``:
    (chunks, hidden)). Computed as ``lm_head @ lasts.T``: a step has a few chunks, and for so
    few rows MKL's ``lasts @ lm_head.T`` path read a (32000, 512) float32 head at a third to a
    sixth of the speed on the 2-core AMD EPYC the project is measured on (2-6 rows: 13-24 ms
    against 2.5-7.4 ms), and its matrix-vector path for one row as slowly (7.3 ms): one row is
    computed as two."""
    rows = len(lasts)
    wide = lasts if rows > 1 else torch.cat([lasts, lasts])
    logits = torch.mm(lm_head, wide.T).T[:rows]  # wide.T as a view: MKL's fast operand order
    return list(logits.to(torch.float32).cpu())


class PagedDecoder(ABC):
    """A pre-norm decoder whose token mixing caches its state in the paged pools.

    A subclass sets the tensors (``embed``, ``lm_head``, the final ``norm``, per layer a dict
    of weights by name), ``config`` (the pools, and each layer's number in them), ``eps``,
    ``rotary`` (None: no position embedding) and :meth:`mix`.
    """

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    embed: torch.Tensor
    lm_head: torch.Tensor  # (vocab, hidden)
    norm: torch.Tensor
    layers: list[dict[str, torch.Tensor]]
    eps: float
    rotary: RotaryTable | None = None
    pairing: Pairing = Pairing.HALF_SPLIT
    norm_names: tuple[str, str] = ("input_layernorm.weight", "post_attention_layernorm.weight")

    def forward(
        self, chunk: ChunkInput, pools: Mapping[str, DevicePool], wait: LayerWait | None = None
    ) -> torch.Tensor:
        """Logits of the chunk's last token (vocab,), after caching the chunk's state."""
        return self.forward_batch([chunk], pools, wait)[0]

    @torch.no_grad()
    def forward_batch(
        self, chunks: Sequence[ChunkInput], pools: Mapping[str, DevicePool],
        wait: LayerWait | None = None, hot: DecodePages | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """One step over several requests' chunks (``wait``: called with each pool a layer
        reads, and the layer's number there, before the layer runs); each chunk's last-token
        logits (vocab,) in float32 on the CPU."""
        self.check_hot(hot)
        step = Step.of(chunks, pools, hot, self.config.vocab_size, self.device)
        if self.rotary is not None:
            cos, sin = self.rotary.at(step.layout.positions, self.dtype)
            step.rotation = Rotation(cos, sin, self.pairing)
        first, second = self.norm_names
        x = self.embed[step.ids]
        for index, weights in enumerate(self.layers):
            if wait is not None:
                for name, number in self.pool_numbers[index].items():
                    wait(name, number)
            h = rms_norm(x, weights[first], self.eps)
            x = x + self.mix(index, h, step)
            h = rms_norm(x, weights[second], self.eps)
            x = x + self.feed_forward(index, h)
        return last_logits(rms_norm(x[step.layout.last_rows], self.norm, self.eps), self.lm_head)

    @functools.cached_property
    def pool_numbers(self) -> list[dict[str, int]]:
        """Each layer's number in every pool it reads (:meth:`ModelConfig.layer_pools`)."""
        return [self.config.layer_pools(i) for i in range(len(self.layers))]

    def check_hot(self, hot: DecodePages | None) -> None:
        """InvalidArgumentError for a HiSparse hot buffer: only a model with DSA layers
        reads one (it overrides this)."""
        if hot is not None:
            raise InvalidArgumentError(
                "HiSparse serves the dsa preset only, not a checkpoint model"
            )

    @abstractmethod
    def mix(self, index: int, h: torch.Tensor, step: Step) -> torch.Tensor:
        """Layer ``index``'s token mixing of the normed hidden states ``h`` (N, hidden)."""

    def feed_forward(self, index: int, h: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s feed-forward block: the SwiGLU MLP ``mlp``."""
        return swiglu(self.layers[index], "mlp", h)
