"""The HiSparse fused step: misses, LRU victims and hot-buffer updates for one layer, batched.

Every decode step, each running request attends to its top-k pages of one layer. Its device hot
buffer holds ``H`` of its pages; the pages it wants but does not hold must be copied in from
host memory, over the least recently used slots. :func:`hot_step` decides all of that for every
running request at once and updates the buffer's page table in place, so that the caller only
has to issue the copies :func:`miss_list` names.

Contract
--------
State of one layer's hot buffers, one row per request:

- ``held: (R, H) int64``: the logical page each of a row's ``H`` slots holds, -1 when empty;
  a page is held by at most one slot of a row.
- ``last_used: (R, H) int64``: the stamp of each slot's last use, -1 never.

``hot_step(held, last_used, rows, wanted, stamp)``:

- ``rows: (B,) int64``: distinct row indices (the running requests).
- ``wanted: (B, K) int64``: the pages each row attends to this step. Values >= 0 are distinct
  within a row; -1 is padding and may appear anywhere in the row. ``K <= H``.
- ``stamp``: an int greater than every stamp in ``last_used``.

For each row, a wanted page already held by a slot is a hit on that slot. Every other wanted
page is a miss and takes a victim slot: the candidates are the row's slots that hold no page
wanted this step, ordered by ``(last_used, slot index)`` ascending, so empty slots (-1) come
first; misses take candidates in that order, in the order of their position in ``wanted``.
There are always enough candidates, since ``K <= H``.

The result's ``slots: (B, K) int64`` is the slot of each wanted page (-1 for padding) and
``miss: (B, K) bool`` says whether it has to be loaded (False for padding). In place, every
wanted page's slot gets ``held[row, slot] = page`` and ``last_used[row, slot] = stamp``; other
slots are untouched.

Two implementations give bit-identical results: :func:`hot_step_torch` (vectorized torch, any
device) and :func:`hot_step_triton` (one Triton program per row, CUDA). :func:`hot_step` picks
the Triton one for CUDA tensors when triton is installed and ``H`` is small enough for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.errors import InvalidArgumentError
from hicache.sparse.hot_step_triton import MAX_TRITON_SLOTS, TRITON_AVAILABLE, launch_hot_step

__all__ = ["HotStep", "hot_step", "hot_step_torch", "hot_step_triton", "miss_list"]

_INT64_MAX = torch.iinfo(torch.int64).max


@dataclass(frozen=True, slots=True)
class HotStep:
    """Where each wanted page of one step lives, and which of them have to be loaded.

    ``slots``: ``(B, K) int64``, the slot of each wanted page, -1 for padding.
    ``miss``: ``(B, K) bool``, True where the page was not held and its slot must be filled.
    """

    slots: torch.Tensor
    miss: torch.Tensor


def hot_step(
    held: torch.Tensor,
    last_used: torch.Tensor,
    rows: torch.Tensor,
    wanted: torch.Tensor,
    stamp: int,
    *,
    check: bool = True,
) -> HotStep:
    """Run one step for the running rows (see the module docstring for the contract).

    ``check=False`` skips the input checks, which cost a few reductions and a device sync; a
    hot caller that builds its inputs correctly can skip them. Inputs that break the contract
    then give unspecified results.
    """
    use_triton = (
        isinstance(held, torch.Tensor)
        and held.is_cuda
        and TRITON_AVAILABLE
        and held.shape[-1] <= MAX_TRITON_SLOTS
    )
    if use_triton:
        return hot_step_triton(held, last_used, rows, wanted, stamp, check=check)
    return hot_step_torch(held, last_used, rows, wanted, stamp, check=check)


def hot_step_triton(
    held: torch.Tensor,
    last_used: torch.Tensor,
    rows: torch.Tensor,
    wanted: torch.Tensor,
    stamp: int,
    *,
    check: bool = True,
) -> HotStep:
    """:func:`hot_step` by the Triton kernel; needs CUDA tensors (or ``TRITON_INTERPRET=1``)."""
    if check:
        check_inputs(held, last_used, rows, wanted, stamp)
    slots, miss = launch_hot_step(held, last_used, rows, wanted, stamp)
    return HotStep(slots=slots, miss=miss)


def hot_step_torch(
    held: torch.Tensor,
    last_used: torch.Tensor,
    rows: torch.Tensor,
    wanted: torch.Tensor,
    stamp: int,
    *,
    check: bool = True,
) -> HotStep:
    """:func:`hot_step` in vectorized torch, on any device, with no host sync when unchecked."""
    if check:
        check_inputs(held, last_used, rows, wanted, stamp)
    n_slots = held.shape[1]
    if wanted.numel() == 0 or n_slots == 0:
        return HotStep(
            slots=torch.full_like(wanted, -1), miss=torch.zeros_like(wanted, dtype=torch.bool)
        )
    held_rows = held.index_select(0, rows)
    last_rows = last_used.index_select(0, rows)
    valid = wanted >= 0

    # Hits by binary search: (B, K + H) memory instead of a (B, K, H) comparison.
    sorted_held, sorted_slot = held_rows.sort(dim=1)
    pos = torch.searchsorted(sorted_held, wanted).clamp_(max=n_slots - 1)
    hit = valid & (sorted_held.gather(1, pos) == wanted)
    hit_slot = sorted_slot.gather(1, pos)
    protected = _scatter_rows(torch.zeros_like(held_rows, dtype=torch.bool), hit, hit_slot, hit)

    # Protected slots get INT64_MAX and so sort after every candidate, whose stamps are all
    # below `stamp`; the stable sort breaks last_used ties by slot index.
    key = last_rows.masked_fill(protected, _INT64_MAX)
    order = key.sort(dim=1, stable=True).indices
    miss = valid & ~hit
    miss_rank = (miss.cumsum(dim=1) - 1).clamp_(min=0)
    victim = order.gather(1, miss_rank)
    slots = torch.where(hit, hit_slot, torch.where(miss, victim, -1))

    held.index_copy_(0, rows, _scatter_rows(held_rows, valid, slots, wanted))
    stamps = torch.full_like(wanted, stamp)
    last_used.index_copy_(0, rows, _scatter_rows(last_rows, valid, slots, stamps))
    return HotStep(slots=slots, miss=miss)


def _scatter_rows(
    base: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """``base`` with ``base[b, slots[b, k]] = values[b, k]`` where ``mask``, as a new tensor.

    Masked-out entries go to a spare column that is cut off afterwards, which avoids boolean
    indexing and with it a device sync.
    """
    n_slots = base.shape[1]
    wide = torch.cat([base, base.new_empty((base.shape[0], 1))], dim=1)
    wide.scatter_(1, torch.where(mask, slots, n_slots), values.to(base.dtype))
    return wide[:, :n_slots]


def miss_list(
    rows: torch.Tensor, wanted: torch.Tensor, result: HotStep
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The misses of a step as ``(miss_rows, miss_pages, miss_slots)``, row-major, 1-D int64.

    These are the host-to-device copies the caller has to issue: page ``miss_pages[i]`` of row
    ``miss_rows[i]`` goes into slot ``miss_slots[i]`` of that row's hot buffer.
    """
    mask = result.miss
    miss_rows = rows[:, None].expand_as(wanted)[mask]
    return miss_rows, wanted[mask], result.slots[mask]


def check_inputs(
    held: torch.Tensor,
    last_used: torch.Tensor,
    rows: torch.Tensor,
    wanted: torch.Tensor,
    stamp: int,
) -> None:
    """Raise :class:`InvalidArgumentError` where the inputs break :func:`hot_step`'s contract."""
    _check_shapes(held, last_used, rows, wanted)
    if isinstance(stamp, bool) or not isinstance(stamp, int):
        raise InvalidArgumentError(f"stamp must be an int, got {type(stamp).__name__}")
    if not -(2**63) <= stamp <= _INT64_MAX:
        raise InvalidArgumentError(f"stamp {stamp} does not fit in int64")
    if last_used.numel() and stamp <= int(last_used.max()):
        raise InvalidArgumentError(
            f"stamp {stamp} must be greater than every stamp in last_used "
            f"(max {int(last_used.max())})"
        )
    _check_rows(rows, held.shape[0])
    _check_pages(wanted, "wanted", allow_padding=True)
    _check_pages(held.index_select(0, rows), "held", allow_padding=False)


def _check_shapes(
    held: torch.Tensor, last_used: torch.Tensor, rows: torch.Tensor, wanted: torch.Tensor
) -> None:
    named = {"held": held, "last_used": last_used, "rows": rows, "wanted": wanted}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor)}")
        if tensor.dtype != torch.int64:
            raise InvalidArgumentError(f"{name} must be int64, got {tensor.dtype}")
        if tensor.device != held.device:
            raise InvalidArgumentError(f"{name} is on {tensor.device}, held on {held.device}")
    if held.dim() != 2 or last_used.shape != held.shape:
        raise InvalidArgumentError(
            f"held and last_used must be (R, H) of one shape, got {tuple(held.shape)} "
            f"and {tuple(last_used.shape)}"
        )
    if rows.dim() != 1 or wanted.dim() != 2 or wanted.shape[0] != rows.shape[0]:
        raise InvalidArgumentError(
            f"rows must be (B,) and wanted (B, K), got {tuple(rows.shape)} "
            f"and {tuple(wanted.shape)}"
        )
    if wanted.shape[1] > held.shape[1]:
        raise InvalidArgumentError(
            f"a row wants up to K={wanted.shape[1]} pages but holds only H={held.shape[1]}"
        )


def _check_rows(rows: torch.Tensor, n_rows: int) -> None:
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= n_rows:
        raise InvalidArgumentError(f"rows must lie in [0, {n_rows}), got {rows.tolist()}")
    ordered = rows.sort().values
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise InvalidArgumentError(f"rows must be distinct, got {rows.tolist()}")


def _check_pages(pages: torch.Tensor, name: str, *, allow_padding: bool) -> None:
    """Values are >= -1 (wanted only), and the pages (>= 0) of each row are distinct."""
    if pages.numel() == 0:
        return
    if allow_padding and bool((pages < -1).any()):
        raise InvalidArgumentError(f"{name} pages must be >= 0, or -1 for padding")
    ordered = pages.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        bad = int(repeated.any(dim=1).nonzero()[0])
        raise InvalidArgumentError(
            f"{name} repeats a page within a row (row {bad} of the step: {pages[bad].tolist()})"
        )
