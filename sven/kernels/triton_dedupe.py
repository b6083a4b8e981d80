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

__all__ = ["compact_sorted"]

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
