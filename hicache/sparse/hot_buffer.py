"""The HiSparse hot buffer: each decoding request's latent on the device is only ``hot_pages``
pages per layer, over its full latent in host memory; its indexer keys stay on the device.

Per decode step and layer (:meth:`HotBuffer.gather`, called by the model once the indexer has
picked each request's top-k pages): the fused step (:func:`~hicache.sparse.hot_step.hot_step`)
finds which of the pages miss the buffer, picks least recently used slots for them and maps
every wanted page to its slot, for all requests at once; the misses are copied host to device
into those slots; the new token's latent is written to its page's slot and, eagerly, to host;
attention then reads the wanted pages from the buffer.

A request's host pages (:class:`HotRequest`): its committed prefix's pages in the radix tree's
host pool (shared with other requests and protected while it decodes), then pages of its own
for the rest of its context. What the request holds is set up and released by
:mod:`hicache.serving.hisparse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.errors import ConfigError
from hicache.layouts.shapes import Axis, axis_order, expanded_shape
from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.types import DecodeRows
from hicache.pools.allocator import TokenSlotAllocator
from hicache.pools.device import take_rows
from hicache.pools.host import HostPool
from hicache.sparse.hot_step import hot_step

__all__ = ["HiSparseConfig", "HotBuffer", "HotRequest", "HotStats", "canonical_pages"]

HOT_PAGES_MAX = 1 << 20


@dataclass(frozen=True, slots=True)
class HiSparseConfig:
    """``hot_pages``: device pages of latent per request and layer (at least the model's top-k
    pages, checked against the model by :meth:`check`); ``index_tokens``: device slots for the
    running requests' indexer keys, whole contexts (0: ``max_running`` x the anchor pool)."""

    hot_pages: int = 16
    index_tokens: int = 0

    def __post_init__(self) -> None:
        for name, low, high in (("hot_pages", 1, HOT_PAGES_MAX), ("index_tokens", 0, 1 << 34)):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ConfigError(f"{name} must be an int in [{low}, {high}], got {value!r}")

    def check(self, model: ModelConfig) -> None:
        """Raise ConfigError unless HiSparse can serve ``model``: a DSA model whose top-k pages
        fit the buffer."""
        if model.preset is not ModelPreset.DSA:
            raise ConfigError(
                f"--hisparse needs the dsa preset (sparse attention), not {model.preset.value!r}"
            )
        if model.index_topk_pages > self.hot_pages:
            raise ConfigError(
                f"the model's top-k ({model.index_topk_pages} pages, --index-topk) is larger than "
                f"the hot buffer (--hot-pages {self.hot_pages}): every page a step attends to "
                "must be on the device at once"
            )


def canonical_pages(host: HostPool) -> torch.Tensor:
    """A view of ``host``'s buffer as (page, component, layer, token, *item), whatever its
    layout (writes through the view write the buffer)."""
    spec, layout = host.spec.layout, host.layout
    expanded = host.buffer.view(expanded_shape(spec, layout, host.num_pages))
    order = axis_order(layout)
    perm = [order.index(axis) for axis in Axis] + list(range(4, expanded.dim()))
    return expanded.permute(perm)


@dataclass(slots=True)
class HotRequest:
    """What one decoding request holds: its buffer row, its indexer slots (positions ``0 ..``),
    and its host pages: the ones it allocated (``own_host``) and the tree's it protects
    (``shared_host``, its prefix), the logical pages' order being shared, then own (the
    buffer's ``host_table`` row)."""

    row: int
    index_slots: torch.Tensor
    own_host: torch.Tensor
    shared_host: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    entered: bool = False  # its prompt is computed and it decodes from the buffer
    waiting_since: float | None = None  # since when entering waits for host memory


@dataclass(slots=True)
class HotStats:
    wanted_pages: int = 0  # top-k pages over every decode row and layer
    missed_pages: int = 0  # of those, the ones copied host to device
    h2d_bytes: int = 0
    decode_rows: int = 0  # decode tokens computed through the buffer

    @property
    def miss_rate(self) -> float:
        return self.missed_pages / self.wanted_pages if self.wanted_pages else 0.0


class HotBuffer:
    """``rows`` requests' hot buffers and indexer keys (``index_tokens`` slots) on ``device``,
    over the latent host pool ``host`` (the tree's)."""

    def __init__(
        self,
        model: ModelConfig,
        config: HiSparseConfig,
        rows: int,
        index_tokens: int,
        host: HostPool,
        device: torch.device | str = "cpu",
    ) -> None:
        config.check(model)
        self.config = config
        self.page_size = ps = model.page_size
        self.hot_pages = hp = config.hot_pages
        self.rows = rows
        self.host = host
        self._host = canonical_pages(host)
        self.device = device = torch.device(device)
        item = host.spec.layout.item_shape
        self.latent = torch.zeros(
            (model.layers, rows * hp, ps, *item), dtype=host.buffer.dtype, device=device
        )
        index_item = (model.index_dim + 4,)
        self._index = torch.zeros(
            (1, model.layers, index_tokens, *index_item), dtype=torch.uint8, device=device
        )
        self.index_slots = TokenSlotAllocator(index_tokens, ps)
        self.held = torch.full((model.layers, rows, hp), -1, dtype=torch.int64, device=device)
        self.last_used = torch.full_like(self.held, -1)
        self.host_table = torch.full((rows, index_tokens // ps), -1, dtype=torch.int64)
        self._free_rows = list(range(rows - 1, -1, -1))
        self.stamp = 0
        self.stats = HotStats()

    @property
    def index(self) -> torch.Tensor:
        return self._index

    @property
    def device_bytes(self) -> int:
        """Bytes this buffer holds on the device: latent pages, indexer keys, page tables."""
        tensors = (self.latent, self._index, self.held, self.last_used)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    # ----- rows -------------------------------------------------------------------------------
    def take_row(self, tokens: int) -> tuple[int, torch.Tensor] | None:
        """A free row and indexer slots for ``tokens`` (whole pages), or None."""
        if not self._free_rows:
            return None
        slots = self.index_slots.alloc(-(-tokens // self.page_size) * self.page_size)
        if slots is None:
            return None
        row = self._free_rows.pop()
        self.held[:, row] = -1
        self.last_used[:, row] = -1
        self.host_table[row] = -1
        return row, slots

    def give_back(self, row: int, index_slots: torch.Tensor) -> None:
        self.index_slots.free(index_slots)
        self._free_rows.append(row)  # its tables are reset when it is taken again

    @property
    def host_latent(self) -> torch.Tensor:
        """The host pool's latent as (page, layer, token, *item): a view of its buffer."""
        return self._host[:, 0]

    def begin_step(self) -> None:
        """A new forward pass: its uses of the buffer are stamped later than every earlier."""
        self.stamp += 1

    # ----- the decode step (DecodePages) ------------------------------------------------------
    def gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> torch.Tensor:
        ps, hp = self.page_size, self.hot_pages
        assert rows.hot_rows is not None  # rows of this buffer
        hot_rows = rows.hot_rows.to(self.held.device)
        wanted = top.to(self.held.device)
        step = hot_step(self.held[layer], self.last_used[layer], hot_rows, wanted, self.stamp,
                        check=False)  # fmt: skip
        slots = step.slots
        self._load_misses(layer, hot_rows, wanted, step.miss, slots)
        self._write_new(layer, hot_rows, rows.positions, slots[:, 0], latent_new)
        buffer_rows = hot_rows[:, None] * hp + slots.clamp_min(0)
        self.stats.wanted_pages += int((wanted >= 0).sum())
        self.stats.decode_rows += len(top) if layer == 0 else 0
        flat = take_rows(self.latent[layer], buffer_rows)  # (B, K, ps, *item)
        return flat.reshape(len(top), top.shape[1] * ps, -1)

    def _load_misses(
        self,
        layer: int,
        rows: torch.Tensor,
        wanted: torch.Tensor,
        miss: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Copy the missed pages of ``layer`` from host into their slots."""
        where = torch.nonzero(miss.cpu())
        if not len(where):
            return
        miss_rows = rows.cpu()[where[:, 0]]
        pages = wanted.cpu()[where[:, 0], where[:, 1]]
        host_pages = self.host_table[miss_rows, pages]
        data = self._host[:, 0, layer][host_pages]  # (M, ps, *item): gathered on the host
        dest = miss_rows * self.hot_pages + slots.cpu()[where[:, 0], where[:, 1]]
        self.latent[layer][dest.to(self.device)] = data.to(self.device, non_blocking=True)
        self.stats.missed_pages += len(where)
        self.stats.h2d_bytes += data.numel() * data.element_size()

    def _write_new(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        own_slots: torch.Tensor,
        latent_new: torch.Tensor,
    ) -> None:
        """The new tokens' latent into their page's slot (the own page is every row's first
        wanted page) and, eagerly, into their host pages."""
        ps = self.page_size
        positions = positions.to(rows.device)
        value = latent_new.view(len(rows), *self.latent.shape[3:]).to(self.latent.dtype)
        self.latent[layer][rows * self.hot_pages + own_slots, positions % ps] = value
        host_rows, host_positions = rows.cpu(), positions.cpu()
        host_pages = self.host_table[host_rows, host_positions // ps]
        if bool((host_pages < 0).any()):
            raise RuntimeError("a HiSparse request wrote past the host pages it holds")
        host_layer = self._host[:, 0, layer]  # a view: writes land in the host pool
        host_layer[host_pages, host_positions % ps] = value.to("cpu", self._host.dtype)
