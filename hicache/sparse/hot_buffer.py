"""The HiSparse hot buffer: each decoding request's latent on the device is only ``hot_pages``
pages per layer, over its full latent in host memory; its indexer keys stay on the device.
"Latent" is the anchor pool's per-token data: DSA's MLA latent, or dsv4's C4 entries (a quarter
entry per token, :mod:`hicache.models.compressed`).

Per decode step and layer (:meth:`HotBuffer.start_gather`, called by the model once the indexer
has picked each request's top-k pages): the fused step (:func:`~hicache.sparse.hot_step.hot_step`)
finds which of the pages miss the buffer, picks least recently used slots for them and maps
every wanted page to its slot, for all requests at once; its result drives one copy job
(:mod:`hicache.sparse.hot_copies`: inline, a copy thread, or a CUDA side stream) that copies the
misses host to device into those slots, then writes the new token's latent to its page's slot
and, eagerly, to host; the layer computes its queries meanwhile, and attention waits for the
job and reads the wanted pages from the buffer. On CUDA the job is computed on the device from
the step's result (no host sync): the host table is mirrored there and the pinned host pool read
and written through its device alias.

A request's host pages (:class:`HotRequest`): its committed prefix's pages in the radix tree's
host pool (shared with other requests and protected while it decodes), then pages of its own
for the rest of its context. What the request holds is set up and released by
:mod:`hicache.serving.hisparse`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache.errors import ConfigError
from hicache.layouts.shapes import Axis, axis_order, expanded_shape
from hicache.layouts.views import host_on_device
from hicache.models.config import ModelConfig, ModelPreset
from hicache.models.types import DecodeRows
from hicache.pools.allocator import TokenSlotAllocator
from hicache.pools.device import take_rows
from hicache.pools.host import HostPool
from hicache.sparse.hot_copies import CopyMode, CopyTimes, layer_copies
from hicache.sparse.hot_step import hot_step

__all__ = [
    "HiSparseConfig",
    "HotBuffer",
    "HotRequest",
    "HotStats",
    "canonical_pages",
    "wanted_pages",
]

HOT_PAGES_MAX = 1 << 20


@dataclass(frozen=True, slots=True)
class HiSparseConfig:
    """``hot_pages``: device pages of latent per request and layer (at least the model's top-k
    pages, checked against the model by :meth:`check`); ``index_tokens``: device slots for the
    running requests' indexer keys, whole contexts (0: ``max_running`` x the anchor pool);
    ``copy_mode``: whether the host-to-device copies overlap the forward
    (:mod:`hicache.sparse.hot_copies`)."""

    hot_pages: int = 16
    index_tokens: int = 0
    copy_mode: CopyMode = CopyMode.OVERLAP

    def __post_init__(self) -> None:
        if not isinstance(self.copy_mode, CopyMode):
            raise ConfigError(f"copy_mode must be a CopyMode, got {self.copy_mode!r}")
        for name, low, high in (("hot_pages", 1, HOT_PAGES_MAX), ("index_tokens", 0, 1 << 34)):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ConfigError(f"{name} must be an int in [{low}, {high}], got {value!r}")

    def check(self, model: ModelConfig, context_tokens: int) -> None:
        """Raise ConfigError unless HiSparse can serve ``model``'s contexts of up to
        ``context_tokens``: a DSA model whose top-k pages fit the buffer, or a dsv4 model whose
        top-k C4 entries' pages and the page its new entry is written to fit it (each entry may
        sit on a page of its own, as far as the context has pages)."""
        if model.preset not in (ModelPreset.DSA, ModelPreset.DSV4):
            raise ConfigError(
                "--hisparse needs the dsa or dsv4 preset (sparse attention), not "
                f"{model.preset.value!r}"
            )
        need = wanted_pages(model, -(-context_tokens // model.page_size))
        if need > self.hot_pages:
            what = (
                f"{model.index_topk_pages} pages"
                if model.preset is ModelPreset.DSA
                else f"{model.index_topk_pages} C4 entries, each maybe on a page of its own, "
                "beside the page its new entries go to"
            )
            raise ConfigError(
                f"the model's top-k ({what}, --index-topk) needs {need} pages, more than the hot "
                f"buffer (--hot-pages {self.hot_pages}): every page a step attends to must be on "
                "the device at once"
            )


def wanted_pages(model: ModelConfig, context_pages: int) -> int:
    """The most pages one decode row wants from its buffer in a layer: DSA's top-k pages (its
    own among them); dsv4's top-k C4 entries' pages and its own page, no more than a context of
    ``context_pages`` has (dsv4 contexts are bounded: C128 keeps every token on the device)."""
    if model.preset is ModelPreset.DSV4:
        return min(model.index_topk_pages + 1, context_pages)
    return model.index_topk_pages


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


@dataclass(frozen=True, slots=True)
class _PageLoads:
    """One layer's step as its copies see it: the buffer ``rows`` (B,), the ``wanted`` pages
    (B, K), the ``slots`` they live in and which of them ``miss`` (were not held)."""

    rows: torch.Tensor
    wanted: torch.Tensor
    slots: torch.Tensor
    miss: torch.Tensor


class HotBuffer:
    """``rows`` requests' hot buffers and indexer keys (``index_tokens`` slots) on ``device``,
    over the latent host pool ``host`` (the tree's), for contexts of up to ``context_tokens``
    (default: ``index_tokens``)."""

    def __init__(
        self,
        model: ModelConfig,
        config: HiSparseConfig,
        rows: int,
        index_tokens: int,
        host: HostPool,
        device: torch.device | str = "cpu",
        *,
        context_tokens: int | None = None,
    ) -> None:
        # No request's context exceeds its indexer slots, nor ``context_tokens`` where the
        # caller bounds it further (dsv4: C128 keeps every token on the device).
        config.check(model, min(index_tokens, context_tokens or index_tokens))
        self.config = config
        self.page_size = ps = model.page_size
        self.hot_pages = hp = config.hot_pages
        self.rows = rows
        self.host = host
        self._host = canonical_pages(host)
        self.device = device = torch.device(device)
        item, layers = host.spec.layout.item_shape, host.spec.layout.layers
        # A spare row past the rows' slots takes the masked copies' non-misses.
        self.latent = torch.zeros(
            (layers, rows * hp + 1, ps, *item), dtype=host.buffer.dtype, device=device
        )
        index = next(p.layout for p in model.pools() if p.name == "indexer")
        self._index = torch.zeros(
            (1, index.layers, index_tokens, *index.item_shape), dtype=torch.uint8, device=device
        )
        self.index_slots = TokenSlotAllocator(index_tokens, ps)
        self.held = torch.full((layers, rows, hp), -1, dtype=torch.int64, device=device)
        self.last_used = torch.full_like(self.held, -1)
        self.host_table = torch.full((rows, index_tokens // ps), -1, dtype=torch.int64)
        self._free_rows = list(range(rows - 1, -1, -1))
        self.stamp = 0
        # On CUDA the copies are computed on the device from the step's result: the host pool
        # read and written through its device alias, the host table mirrored there.
        self.masked_copies = device.type == "cuda"
        self._device_table = self.host_table.to(device)
        self._host_view = self._host if device.type == "cpu" else _on_device(self._host, device)
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)  # wanted, missed
        self._decode_rows = 0
        self.copies = layer_copies(config.copy_mode, device)

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
        self.set_host_pages(row, self.host_table[row, :0])
        return row, slots

    def set_host_pages(self, row: int, pages: torch.Tensor) -> None:
        """Row ``row``'s logical pages are host pages ``pages`` (the rest: none)."""
        self.host_table[row] = -1
        self.host_table[row, : len(pages)] = pages
        if self._device_table is not self.host_table:
            self._device_table[row] = self.host_table[row].to(self.device)

    @property
    def stats(self) -> HotStats:
        """The counts so far (read from the device: a sync on CUDA)."""
        wanted, missed = self._counts.tolist()
        page_bytes = self.latent[0, 0].numel() * self.latent.element_size()
        return HotStats(wanted, missed, missed * page_bytes, self._decode_rows)

    @property
    def copy_times(self) -> CopyTimes:
        """How long the copies ran and how long the forward waited for them."""
        self.copies.drain()
        return self.copies.times

    def close(self) -> None:
        """Stop the copier (its thread, on the CPU with overlapped copies)."""
        self.copies.close()

    def give_back(self, row: int, index_slots: torch.Tensor) -> None:
        self.index_slots.free(index_slots)
        self._free_rows.append(row)  # its tables are reset when it is taken again

    @property
    def host_latent(self) -> torch.Tensor:
        """The host pool's latent as (page, layer, token, *item): a view of its buffer."""
        return self._host[:, 0]

    def drain(self) -> None:
        """Wait until every copy issued so far has landed."""
        self.copies.drain()

    def begin_step(self) -> None:
        """A new forward pass: its uses of the buffer are stamped later than every earlier.
        The last pass's copies have landed (its layers waited for them): settling them here
        costs no wait and keeps the copier's bookkeeping bounded."""
        self.copies.drain()
        self.stamp += 1

    # ----- the decode step (DecodePages) ------------------------------------------------------
    def gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> torch.Tensor:
        return self.start_gather(layer, rows, top, latent_new)()

    def start_gather(
        self, layer: int, rows: DecodeRows, top: torch.Tensor, latent_new: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """Run the fused step for ``layer`` and launch its copies (misses, then the new
        latent); the returned callable waits for them and gives the latent of the ``top``
        pages. ``latent_new`` (B, n x item): each row's latent of its last ``n`` positions, up
        to its new token's, all on its own page (``top``'s first): DSA a token's (n = 1), dsv4
        a C4 entry's 4 slots where the token completes a group, else nothing (n = 0)."""
        ps, hp = self.page_size, self.hot_pages
        assert rows.hot_rows is not None  # rows of this buffer
        hot_rows = rows.hot_rows.to(self.held.device)
        wanted = top.to(self.held.device)
        step = hot_step(self.held[layer], self.last_used[layer], hot_rows, wanted, self.stamp,
                        check=False)  # fmt: skip
        self._counts[0] += (wanted >= 0).sum()
        self._counts[1] += step.miss.sum()
        self._decode_rows += len(top) if layer == 0 else 0
        positions = rows.positions.to(self.held.device)
        value = latent_new.view(len(top), -1, *self.latent.shape[3:]).to(self.latent.dtype)
        loads = _PageLoads(hot_rows, wanted, step.slots, step.miss)
        inputs = (hot_rows, wanted, step.slots, step.miss, positions, value)
        pending = self.copies.launch(
            lambda: self._copy_layer(layer, loads, positions, value), inputs
        )
        buffer_rows = hot_rows[:, None] * hp + step.slots.clamp_min(0)

        def latent() -> torch.Tensor:
            pending.wait()
            flat = take_rows(self.latent[layer], buffer_rows)  # (B, K, ps, *item)
            return flat.reshape(len(top), top.shape[1] * ps, -1)

        return latent

    def _copy_layer(
        self, layer: int, loads: _PageLoads, positions: torch.Tensor, value: torch.Tensor
    ) -> None:
        """One layer's copies, in order: the misses into their slots, then the new latent
        (``value``: (B, n, *item), positions up to ``positions``) into its page's slot (every
        row's first wanted page: its own) and to host."""
        hp = self.hot_pages
        if self.masked_copies:
            self._load_masked(layer, loads)
        else:
            self._load_listed(layer, loads)
        rows, slots = loads.rows, loads.slots
        written = value.shape[1]
        if not written:
            return
        ps = self.page_size
        spans = positions[:, None] - written + 1 + torch.arange(written, device=positions.device)
        latent = self.latent[layer]
        latent[(rows * hp + slots[:, 0])[:, None], spans % ps] = value
        table = self._device_table if self.masked_copies else self.host_table
        host_rows, host_spans = rows.to(table.device), spans.to(table.device)
        host_pages = table[host_rows[:, None], host_spans // ps]
        host_layer = self._host_view[:, 0, layer]  # writes land in the host pool
        host_layer[host_pages, host_spans % ps] = value.to(host_layer.device, host_layer.dtype)

    def _load_listed(self, layer: int, loads: _PageLoads) -> None:
        """The misses as a list (on the CPU, where listing them costs no device sync)."""
        where = torch.nonzero(loads.miss)
        if not len(where):
            return
        miss_rows = loads.rows[where[:, 0]]
        host_pages = self.host_table[miss_rows, loads.wanted[where[:, 0], where[:, 1]]]
        dest = miss_rows * self.hot_pages + loads.slots[where[:, 0], where[:, 1]]
        self.latent[layer].index_copy_(0, dest, self._host[:, 0, layer].index_select(0, host_pages))

    def _load_masked(self, layer: int, loads: _PageLoads) -> None:
        """Every wanted position copies a page, so that nothing waits for the number of
        misses: a miss its host page into its slot, any other host page 0 into the spare row
        past every buffer row (the host pool read through its device alias on CUDA)."""
        hp = self.hot_pages
        rows, wanted, slots, miss = loads.rows, loads.wanted, loads.slots, loads.miss
        pages = self._device_table[rows[:, None], wanted.clamp_min(0)]
        source = torch.where(miss, pages, 0).flatten()
        spare = self.latent.shape[1] - 1
        dest = torch.where(miss, rows[:, None] * hp + slots, spare).flatten()
        self.latent[layer].index_copy_(
            0, dest, self._host_view[:, 0, layer].index_select(0, source)
        )


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a view of a pinned host buffer) read and written by ``device``'s kernels
    through unified addressing, without a copy."""
    base: torch.Tensor = host
    while base._base is not None:
        base = base._base
    alias = host_on_device(base, device)
    offset = host.storage_offset() - base.storage_offset()
    view: torch.Tensor = alias.as_strided(
        host.shape, host.stride(), alias.storage_offset() + offset
    )
    return view
