"""Triton kernel of the HiSparse fused step: one program per running request row.

The contract is :func:`hicache.sparse.hot_step.hot_step`'s; this module holds only the kernel and
its launch, without input checks, so that ``hot_step`` can import it without a cycle. Importing
it never fails: without triton, :data:`TRITON_AVAILABLE` is False and :func:`launch_hot_step`
raises.

The victim order comes from a pairwise comparison of a row's slots, ``O(H^2)`` work per row
done in tiles, and hits from a ``(K, H)`` comparison held in one block, so the kernel accepts at
most :data:`MAX_TRITON_SLOTS` slots per row (Triton caps a block at ``2**20`` elements, and
beyond that the per-row work outgrows the torch version's sort); the dispatcher uses the torch
version above it.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache.errors import InvalidArgumentError

__all__ = ["MAX_TRITON_SLOTS", "TRITON_AVAILABLE", "launch_hot_step"]

MAX_TRITON_SLOTS = 1024
# Slots compared per iteration of the rank loop, bounding its live tile at (32, BLOCK_H).
_RANK_CHUNK = 32

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: CPU-only installs use the torch version
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

_kernel: Any = None

if TRITON_AVAILABLE:

    @triton.jit  # type: ignore[untyped-decorator]
    def _candidate_rank(  # type: ignore[no-untyped-def]
        held_row,
        last_row,
        held_s1,
        last_s1,
        n_slots,
        want,
        last,
        BLOCK_H: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Per slot j, the candidates i ahead of it in (last_used, slot) order.

        For the candidates these ranks are exactly 0 .. n_candidates - 1. The pairs are compared
        a CHUNK of i at a time to bound the live tile at (CHUNK, BLOCK_H) instead of H^2.
        """
        offs_h = tl.arange(0, BLOCK_H)
        rank = tl.zeros([BLOCK_H], dtype=tl.int32)
        for start in range(0, BLOCK_H, CHUNK):
            offs_c = start + tl.arange(0, CHUNK)
            in_c = offs_c < n_slots
            held_c = tl.load(held_row + offs_c * held_s1, mask=in_c, other=-1)
            last_c = tl.load(last_row + offs_c * last_s1, mask=in_c, other=0)
            wanted_c = (want[:, None] == held_c[None, :]) & (want[:, None] >= 0)
            cand_c = in_c & (tl.max(wanted_c.to(tl.int32), axis=0) == 0)
            ahead = (last_c[:, None] < last[None, :]) | (
                (last_c[:, None] == last[None, :]) & (offs_c[:, None] < offs_h[None, :])
            )
            rank += tl.sum((cand_c[:, None] & ahead).to(tl.int32), axis=0)
        return rank

    # `stamp` grows every step; without do_not_specialize Triton would treat the value 1 as a
    # constant and compile another variant for it.
    @triton.jit(do_not_specialize=["stamp"])  # type: ignore[untyped-decorator]
    def _hot_step_kernel(  # type: ignore[no-untyped-def]
        held_ptr,
        last_ptr,
        rows_ptr,
        wanted_ptr,
        slots_ptr,
        miss_ptr,
        stamp,
        n_slots,
        n_wanted,
        held_s0,
        held_s1,
        last_s0,
        last_s1,
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + b)
        offs_h = tl.arange(0, BLOCK_H)
        offs_k = tl.arange(0, BLOCK_K)
        in_h = offs_h < n_slots
        in_k = offs_k < n_wanted
        held_row = held_ptr + row * held_s0
        last_row = last_ptr + row * last_s0
        held = tl.load(held_row + offs_h * held_s1, mask=in_h, other=-1)
        last = tl.load(last_row + offs_h * last_s1, mask=in_h, other=0)
        want = tl.load(wanted_ptr + b * n_wanted + offs_k, mask=in_k, other=-1)

        valid = want >= 0
        eq = (want[:, None] == held[None, :]) & valid[:, None] & in_h[None, :]
        hit_slot = tl.max(tl.where(eq, offs_h[None, :], -1), axis=1)
        hit = hit_slot >= 0
        cand = in_h & (tl.max(eq.to(tl.int32), axis=0) == 0)
        rank = _candidate_rank(
            held_row, last_row, held_s1, last_s1, n_slots, want, last, BLOCK_H, CHUNK
        )

        # The n-th miss (by position in `wanted`) takes the candidate of rank n.
        miss = valid & (hit == 0)
        miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        match = miss[:, None] & cand[None, :] & (rank[None, :] == miss_rank[:, None])
        victim = tl.max(tl.where(match, offs_h[None, :], -1), axis=1)
        slot = tl.where(hit, hit_slot, tl.where(miss, victim, -1))

        tl.store(slots_ptr + b * n_wanted + offs_k, slot.to(tl.int64), mask=in_k)
        tl.store(miss_ptr + b * n_wanted + offs_k, miss.to(tl.int8), mask=in_k)
        stamps = tl.zeros([BLOCK_K], dtype=tl.int64) + stamp
        store = in_k & valid
        tl.store(held_row + slot * held_s1, want, mask=store)
        tl.store(last_row + slot * last_s1, stamps, mask=store)

    _kernel = _hot_step_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_hot_step(
    held: torch.Tensor,
    last_used: torch.Tensor,
    rows: torch.Tensor,
    wanted: torch.Tensor,
    stamp: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on checked inputs; returns ``(slots, miss)`` and updates ``held`` in place.

    The tensors must be on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` set before
    triton was imported.
    """
    if not TRITON_AVAILABLE:
        raise InvalidArgumentError("hot_step_triton needs triton, which is not installed")
    n_slots = held.shape[1]
    if n_slots > MAX_TRITON_SLOTS:
        raise InvalidArgumentError(
            f"hot_step_triton handles at most {MAX_TRITON_SLOTS} slots per row, got {n_slots}"
        )
    b, k = wanted.shape
    slots = torch.full((b, k), -1, dtype=torch.int64, device=wanted.device)
    miss = torch.zeros((b, k), dtype=torch.int8, device=wanted.device)
    if b == 0 or k == 0:
        return slots, miss.view(torch.bool)
    block_h = _next_pow2(n_slots)
    _kernel[(b,)](
        held,
        last_used,
        rows.contiguous(),
        wanted.contiguous(),
        slots,
        miss,
        stamp,
        n_slots,
        k,
        held.stride(0),
        held.stride(1),
        last_used.stride(0),
        last_used.stride(1),
        BLOCK_H=block_h,
        BLOCK_K=_next_pow2(k),
        CHUNK=min(block_h, _RANK_CHUNK),
        num_warps=4 if block_h <= 128 else 8,
    )
    return slots, miss.view(torch.bool)
