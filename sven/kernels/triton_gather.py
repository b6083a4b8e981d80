"""A row gather whose backward sums over the de-duplication's sorted runs.

A batch reads its node rows by position: ``z[root_pos]``, ``kv[nbr_pos]``. The
backward of such a gather sums the gradients of the positions that read one row. On
CUDA PyTorch does it by sorting the positions again (an embedding backward: a radix
sort and half a dozen segment kernels), although the batch's de-duplication
(:func:`sven.pipeline.dedupe.dedupe_fixed`) sorted the same ids a moment before: its
permutation lists, run by run, the positions that read each row. Here the backward is
one kernel over those runs, in a fixed order (deterministic, no atomics):

- each program takes CH consecutive entries of the sorted order and a block of
  columns; the entries of one run are summed by one product with a 0/1 matrix
  (``A[j, i] = 1`` where entries i and j share a run), exact in IEEE products;
- the run that starts in the chunk and runs past its end is followed, tile by tile,
  by the same program; a run that started in an earlier chunk is that chunk's;
- the run of the padding id (masked neighbour slots, whose gradient is zero) and the
  unused slots are written as zeros.

Contract: for every position i of the gather whose gradient may be nonzero,
``idx[i] == inverse[lo + i]`` (the de-duplication's slot of that id). Masked
neighbour slots read other rows (a row of their own) but receive a zero gradient from
the masked attention, so they need not be counted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_rows_sorted", "segment_sum"]

_CH = 32
_BC = 64


@triton.jit
def _segment_sum_kernel(
    g_ptr, perm_ptr, inv_ptr, sid_ptr, out_ptr, S, G, lo, pad_id, U, D,
    CH: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = cols < D
    j = c * CH + tl.arange(0, CH)
    jm = j < S
    p = tl.load(perm_ptr + j, mask=jm, other=0)
    s = tl.load(inv_ptr + p, mask=jm, other=-1)
    r = p - lo
    inr = jm & (r >= 0) & (r < G)
    gt = tl.load(g_ptr + r[:, None] * D + cols[None, :], mask=inr[:, None] & cm[None, :], other=0.0)
    same = (s[:, None] == s[None, :]).to(tl.float32)
    part = tl.dot(same, gt, input_precision="ieee")
    p_prev = tl.load(perm_ptr + j - 1, mask=jm & (j > 0), other=0)
    s_prev = tl.load(inv_ptr + p_prev, mask=jm & (j > 0), other=-1)
    first = jm & (s != s_prev)
    # The chunk's last run may go on past its end: the program where it starts follows
    # it (a run that started earlier is its own chunk's), unless it is the padding's.
    last = tl.minimum(c * CH + CH, S) - 1
    s_last = tl.load(inv_ptr + tl.load(perm_ptr + last))
    starts_here = tl.sum((first & (s == s_last)).to(tl.int32), axis=0) > 0
    not_pad = tl.load(sid_ptr + last).to(tl.int64) != pad_id
    extra = tl.zeros([BC], tl.float32)
    jj = c * CH + CH
    go = (jj < S) & starts_here & not_pad
    if go:
        go = tl.load(inv_ptr + tl.load(perm_ptr + jj)) == s_last
    while go:
        jt = jj + tl.arange(0, CH)
        mt = jt < S
        pt = tl.load(perm_ptr + jt, mask=mt, other=0)
        st = tl.load(inv_ptr + pt, mask=mt, other=-1)
        rt = pt - lo
        it = mt & (st == s_last) & (rt >= 0) & (rt < G)
        xm = it[:, None] & cm[None, :]
        x = tl.load(g_ptr + rt[:, None] * D + cols[None, :], mask=xm, other=0.0)
        extra += tl.sum(x, axis=0)
        jj += CH
        go = jj < S
        if go:
            go = tl.load(inv_ptr + tl.load(perm_ptr + jj)) == s_last
    total = part + tl.where(s == s_last, 1.0, 0.0)[:, None] * extra[None, :]
    node = tl.load(sid_ptr + j, mask=first, other=0).to(tl.int64)
    total = tl.where((node == pad_id)[:, None], 0.0, total)
    sm = first[:, None] & cm[None, :]
    tl.store(out_ptr + s[:, None].to(tl.int64) * D + cols[None, :], total, mask=sm)
    # Slots past the distinct ids hold no run: zeros.
    nd = tl.load(inv_ptr + tl.load(perm_ptr + S - 1)) + 1
    z = c * CH + tl.arange(0, CH)
    zm = (z >= nd) & (z < U)
    zero = tl.zeros([CH, BC], tl.float32)
    zm2 = zm[:, None] & cm[None, :]
    tl.store(out_ptr + z[:, None].to(tl.int64) * D + cols[None, :], zero, mask=zm2)


def segment_sum(
    g: torch.Tensor,
    perm: torch.Tensor,
    inverse: torch.Tensor,
    sorted_ids: torch.Tensor,
    pad_id: int,
    lo: int,
    slots: int,
) -> torch.Tensor:
    """Per de-duplicated slot, the sum of the rows of ``g`` whose positions it holds.

    Args:
        g: (G, D) float32 gradient of positions ``lo .. lo + G`` of the id list.
        perm: (S,) int64 the de-duplication's sort permutation of the S ids.
        inverse: (S,) int64 the slot of each id.
        sorted_ids: (S,) int32 or int64 the ids in the sort's order.
        pad_id: The padding id: its run sums to zero (masked slots).
        lo: The position of ``g``'s first row among the ids.
        slots: U, the de-duplication's slot count.

    Returns:
        (U, D) float32.
    """
    s, u, d = perm.shape[0], slots, g.shape[1]
    out = g.new_empty((u, d))
    if s == 0:
        return out.zero_()
    grid = (triton.cdiv(max(s, u), _CH), triton.cdiv(d, _BC))
    _segment_sum_kernel[grid](
        g, perm, inverse, sorted_ids, out, s, g.shape[0], lo, pad_id, u, d, CH=_CH, BC=_BC
    )
    return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, idx, perm, inverse, sorted_ids, pad_id, lo):
        ctx.save_for_backward(perm, inverse, sorted_ids)
        ctx.pad_id, ctx.lo, ctx.slots = pad_id, lo, table.shape[0]
        return table[idx]

    @staticmethod
    def backward(ctx, grad):
        perm, inverse, sorted_ids = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).contiguous()
        dt = segment_sum(g, perm, inverse, sorted_ids, ctx.pad_id, ctx.lo, ctx.slots)
        return dt, None, None, None, None, None, None


def gather_rows_sorted(
    table: torch.Tensor,
    idx: torch.Tensor,
    perm: torch.Tensor,
    inverse: torch.Tensor,
    sorted_ids: torch.Tensor,
    pad_id: int,
    lo: int,
) -> torch.Tensor:
    """``table[idx]``, its backward one pass over the de-duplication's runs.

    Args:
        table: (U, D) float32 rows, one per de-duplicated slot.
        idx: (...) int64 slot read at positions ``lo ..`` of the id list (see the
            module's contract for masked positions).
        perm, inverse, sorted_ids, pad_id: The de-duplication (:func:`segment_sum`).
        lo: Position of ``idx``'s first entry among the ids.

    Returns:
        (..., D).
    """
    return _GatherRows.apply(table, idx, perm, inverse, sorted_ids, pad_id, lo)
