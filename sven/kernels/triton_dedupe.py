"""De-duplication after the sort, as one Triton kernel.

``pipeline.dedupe.dedupe_fixed`` sorts a batch's ids, then marks each run's first id,
numbers the runs with a prefix sum and scatters twice (each input's slot, each slot's
id) over a padding-filled output: about ten kernels on CUDA after the sort. Here one
program walks the sorted ids in blocks with a running count, and writes the same two
outputs. The reference (the CPU path and the oracle) is ``dedupe_fixed`` itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["COUNT_MAX_RANGE", "compact_sorted", "dedupe_count"]

_BLOCK = 4096


@triton.jit
def _compact_kernel(
    sorted_ptr, perm_ptr, nodes_ptr, inverse_ptr, S, U, pad_id,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # One program: the running count of distinct ids carries across the blocks.
    seen = tl.full([], 0, tl.int64)
    for start in range(0, S, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < S
        x = tl.load(sorted_ptr + offs, mask=m, other=0).to(tl.int64)
        before = tl.load(sorted_ptr + offs - 1, mask=m & (offs > 0), other=0).to(tl.int64)
        first = m & ((offs == 0) | (x != before))
        slot = seen + tl.cumsum(first.to(tl.int32), axis=0).to(tl.int64) - 1
        p = tl.load(perm_ptr + offs, mask=m, other=0)
        tl.store(inverse_ptr + p, slot, mask=m)
        tl.store(nodes_ptr + slot, x, mask=first)
        seen += tl.sum(first.to(tl.int32), axis=0).to(tl.int64)
    for start in range(0, U, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        pad = tl.zeros([BLOCK], tl.int64) + pad_id
        tl.store(nodes_ptr + offs, pad, mask=(offs >= seen) & (offs < U))


def compact_sorted(
    sorted_ids: torch.Tensor, perm: torch.Tensor, pad_id: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids in ``slots`` slots and each input's slot, from a sort.

    Args:
        sorted_ids: (S,) int32 or int64 ids in ascending order.
        perm: (S,) int64 the sort's permutation: ``sorted_ids == ids[perm]``.
        pad_id: The id of the unused slots.
        slots: U, at least the number of distinct ids.

    Returns:
        nodes (U,) int64: the distinct ids ascending, then ``pad_id``; inverse (S,)
        int64: the slot of each input in its original order.
    """
    s = sorted_ids.numel()
    nodes = torch.empty(slots, dtype=torch.int64, device=sorted_ids.device)
    inverse = torch.empty(s, dtype=torch.int64, device=sorted_ids.device)
    if s or slots:
        _compact_kernel[(1,)](sorted_ids, perm, nodes, inverse, s, slots, pad_id, BLOCK=_BLOCK)
    return nodes, inverse


@triton.jit
def _count_kernel(
    ids_ptr, cnt_ptr, start_ptr, slot_ptr, nodes_ptr, inverse_ptr, perm_ptr, sorted_ptr,
    S, U, R, pad_id,
    BLOCK: tl.constexpr, SCAN: tl.constexpr,
):  # fmt: skip
    # One program (its threads synchronise between the passes): a counting sort of ids
    # in [0, R), stable, with the de-duplication's outputs on the way.
    # 1. How often each id occurs (integer atomics: the counts do not depend on order).
    for b in range(0, S, SCAN):
        offs = b + tl.arange(0, SCAN)
        m = offs < S
        x = tl.load(ids_ptr + offs, mask=m, other=0)
        tl.atomic_add(cnt_ptr + x, tl.full([SCAN], 1, tl.int32), mask=m)
    tl.debug_barrier()
    # 2. Each id's first position in the sorted order and its slot, ascending.
    pos = tl.full([], 0, tl.int32)
    seen = tl.full([], 0, tl.int32)
    for b in range(0, R, SCAN):
        offs = b + tl.arange(0, SCAN)
        m = offs < R
        c = tl.load(cnt_ptr + offs, mask=m, other=0)
        present = c > 0
        tl.store(start_ptr + offs, pos + tl.cumsum(c, axis=0) - c, mask=m)
        slot = seen + tl.cumsum(present.to(tl.int32), axis=0) - 1
        tl.store(slot_ptr + offs, slot, mask=m & present)
        tl.store(nodes_ptr + slot, offs.to(tl.int64), mask=m & present)
        pos += tl.sum(c, axis=0)
        seen += tl.sum(present.to(tl.int32), axis=0)
    tl.debug_barrier()
    # 3. In input order, block by block: each id's place is its run's cursor plus the
    # earlier equal ids of the block (stable, as a radix sort), then the cursor moves.
    lane = tl.arange(0, BLOCK)
    for b in range(0, S, BLOCK):
        offs = b + lane
        m = offs < S
        x = tl.load(ids_ptr + offs, mask=m, other=-1)
        eq = (x[:, None] == x[None, :]) & m[None, :]
        before = tl.sum((eq & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
        after = tl.sum((eq & (lane[None, :] > lane[:, None])).to(tl.int32), axis=1)
        xs = tl.where(m, x, 0)
        cur = tl.load(start_ptr + xs, mask=m, other=0)
        at = cur + before
        tl.store(perm_ptr + at, offs.to(tl.int64), mask=m)
        tl.store(sorted_ptr + at, x.to(sorted_ptr.dtype.element_ty), mask=m)
        tl.store(inverse_ptr + offs, tl.load(slot_ptr + xs, mask=m, other=0).to(tl.int64), mask=m)
        # The last occurrence in the block moves the run's cursor past the block's ids.
        tl.store(start_ptr + xs, at + 1, mask=m & (after == 0))
        tl.debug_barrier()
    for b in range(0, U, SCAN):
        offs = b + tl.arange(0, SCAN)
        pad = tl.zeros([SCAN], tl.int64) + pad_id
        tl.store(nodes_ptr + offs, pad, mask=(offs >= seen) & (offs < U))


#: The largest id range (``pad_id + 1``) the counting de-duplication takes: its second
#: pass walks every possible id, in one program.
COUNT_MAX_RANGE = 1 << 16


def dedupe_count(
    ids: torch.Tensor, pad_id: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pipeline.dedupe.dedupe_sorted`` without a sort: one counting-sort program.

    Args:
        ids: (S,) int64 ids in [0, pad_id], ``pad_id < COUNT_MAX_RANGE``.
        pad_id: The id of the unused slots.
        slots: U, at least the number of distinct ids.

    Returns:
        nodes (U,) int64, inverse (S,) int64, perm (S,) int64 (stable: equal ids in input
        order) and sorted_ids (S,) int32, as ``dedupe_sorted``.
    """
    s, r = ids.shape[0], pad_id + 1
    dev = ids.device
    cnt = torch.zeros(r, dtype=torch.int32, device=dev)
    start = torch.empty(r, dtype=torch.int32, device=dev)
    slot = torch.empty(r, dtype=torch.int32, device=dev)
    nodes = torch.empty(slots, dtype=torch.int64, device=dev)
    inverse = torch.empty(s, dtype=torch.int64, device=dev)
    perm = torch.empty(s, dtype=torch.int64, device=dev)
    sorted_ids = torch.empty(s, dtype=torch.int32, device=dev)
    if s or slots:
        _count_kernel[(1,)](
            ids, cnt, start, slot, nodes, inverse, perm, sorted_ids, s, slots, r, pad_id,
            BLOCK=128, SCAN=1024, num_warps=16,
        )  # fmt: skip
    return nodes, inverse, perm, sorted_ids
