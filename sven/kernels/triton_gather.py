"""A row gather whose backward sums over the de-duplication's sorted runs.

A batch reads its node rows by position: ``z[root_pos]``, ``kv[nbr_pos]``. The
backward of such a gather sums the gradients of the positions that read one row. On
CUDA PyTorch does it by sorting the positions again (an embedding backward: a radix
sort and half a dozen segment kernels), although the batch's de-duplication
(:func:`sven.pipeline.dedupe.dedupe_fixed`) sorted the same ids a moment before: its
permutation lists, run by run, the positions that read each row. Here the backward is
one kernel over those runs, in a fixed order (deterministic, no atomics):

- each program takes CH consecutive entries of the sorted order and a block of
  columns; runs are told apart by the sorted ids themselves (read beside the
  permutation, so a row waits for two reads, not three), and the entries of one run
  are summed by one product with a 0/1 matrix (``A[j, i] = 1`` where entries i and j
  share a run), exact in IEEE products;
- the run that starts in the chunk and runs past its end is followed by the same
  program in tiles of W entries (a hub's few hundred entries in a step or two), each
  step deciding the next from its own sorted ids; a run that started in an earlier
  chunk is that chunk's;
- the padding id's run is the last of the sorted order (its id is the largest): a
  chunk that starts in it loads nothing, and its rows are never read. The padding's
  slot and the slots past the distinct ids are written as zeros, which the caller's
  autograd needs (the (U, D) gradient flows on, whole, into the GEMMs that made the
  table).

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

# Sorted entries and columns a program takes (a 32-column row block is one 128-byte
# line), and the entries of a run's walk per step; benchmarks/bench_segment_sum.py
# times other choices.
_CH = 32
_BC = 32
_WALK = 256
_WARPS = 4


@triton.jit
def _walk(
    g_ptr, perm_ptr, sid_ptr, key, jj, S, G, lo, D, cols, cm, BC: tl.constexpr, W: tl.constexpr
):  # fmt: skip
    """(BC,) the sum of the rows of id ``key``'s run from sorted entry ``jj`` on."""
    extra = tl.zeros([BC], tl.float32)
    go = jj < S
    while go:
        jt = jj + tl.arange(0, W)
        mt = jt < S
        # The run is told by the sorted ids, read beside the permutation: a step waits
        # for two reads (the permutation, then the rows), not three.
        run = mt & (tl.load(sid_ptr + jt, mask=mt, other=-1).to(tl.int64) == key)
        rt = tl.load(perm_ptr + jt, mask=mt, other=0) - lo
        it = run & (rt >= 0) & (rt < G)
        xm = it[:, None] & cm[None, :]
        x = tl.load(g_ptr + rt[:, None] * D + cols[None, :], mask=xm, other=0.0)
        extra += tl.sum(x, axis=0)
        jj += W
        go = (jj < S) & (tl.sum(run.to(tl.int32), axis=0) == W)
    return extra


@triton.jit
def _chunk_sums(
    g_ptr, perm_ptr, inv_ptr, sid_ptr, out_ptr, c0, tail, before, key, after,
    S, G, lo, pad_id, D, cols, cm, CH: tl.constexpr, BC: tl.constexpr, W: tl.constexpr,
):  # fmt: skip
    """Writes the sums of the runs that start among sorted entries c0 .. tail: a run
    that started in an earlier chunk (id ``before``, the entry before c0) is that
    chunk's; the last run (id ``key``), if it goes on past the chunk (entry ``after``),
    is followed here to its end."""
    j = c0 + tl.arange(0, CH)
    jm = j < S
    sid = tl.load(sid_ptr + j, mask=jm, other=-1).to(tl.int64)
    nxt = tl.load(sid_ptr + j + 1, mask=(j + 1) < S, other=-1).to(tl.int64)
    p = tl.load(perm_ptr + j, mask=jm, other=0)
    r = p - lo
    live = jm & (sid != pad_id)
    xm = (live & (r >= 0) & (r < G))[:, None] & cm[None, :]
    x = tl.load(g_ptr + r[:, None] * D + cols[None, :], mask=xm, other=0.0)
    longer = (key == after) & (key != before) & (key != pad_id)
    extra = tl.zeros([BC], tl.float32)
    if longer:
        extra = _walk(g_ptr, perm_ptr, sid_ptr, key, tail + 1, S, G, lo, D, cols, cm, BC, W)
    # The entries of one run summed by one product with a 0/1 matrix (exact in IEEE
    # products: each sum adds the same terms, in the product's fixed order).
    same = (sid[:, None] == sid[None, :]).to(tl.float32)
    part = tl.dot(same, x, input_precision="ieee")
    total = tl.where(((j == tail) & longer)[:, None], part + extra[None, :], part)
    # One store per run, from its last entry in the chunk.
    keep = live & (sid != before) & ((sid != nxt) | (j == tail))
    slot = tl.load(inv_ptr + p, mask=keep, other=0)
    sm = keep[:, None] & cm[None, :]
    tl.store(out_ptr + slot[:, None] * D + cols[None, :], total, mask=sm)


# G, lo, pad_id and U only bound rows or shift gathered positions: values that differ
# between a step's calls (one per table it reads) would otherwise each be a compiled
# variant. D (the column stride) stays specialised, for vector loads of a row.
@triton.jit(do_not_specialize=["G", "lo", "pad_id", "U"])
def _segment_sum_kernel(
    g_ptr, perm_ptr, inv_ptr, sid_ptr, out_ptr, S, G, lo, pad_id, U, D,
    CH: tl.constexpr, BC: tl.constexpr, W: tl.constexpr,
):  # fmt: skip
    c0 = tl.program_id(0) * CH
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = cols < D
    # The sorted order's last entry tells the distinct ids (read here, used last).
    last_p = tl.load(perm_ptr + S - 1)
    pad_last = (tl.load(sid_ptr + S - 1).to(tl.int64) == pad_id).to(tl.int64)
    # The padding's run is the last (its id is the largest): a chunk that starts in it
    # holds no sum to write.
    lead = tl.load(sid_ptr + c0, mask=c0 < S, other=pad_id).to(tl.int64)
    # Read beside it, so that a hub's walk waits for one read before its own.
    before = tl.load(sid_ptr + c0 - 1, mask=(c0 > 0) & (c0 < S), other=-1).to(tl.int64)
    tail = tl.minimum(c0 + CH, S) - 1
    key = tl.load(sid_ptr + tail, mask=c0 < S, other=pad_id).to(tl.int64)
    after = tl.load(sid_ptr + tail + 1, mask=tail + 1 < S, other=-1).to(tl.int64)
    if lead != pad_id:
        _chunk_sums(
            g_ptr, perm_ptr, inv_ptr, sid_ptr, out_ptr, c0, tail, before, key, after,
            S, G, lo, pad_id, D, cols, cm, CH, BC, W,
        )  # fmt: skip
    # The padding's slot (the last distinct id's, where it occurs) and the slots past
    # the distinct ids are zeros (rows no run's sum writes).
    nd = tl.load(inv_ptr + last_p) + 1 - pad_last
    z = c0 + tl.arange(0, CH)
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
    args = (g, perm, inverse, sorted_ids, out, s, g.shape[0], lo, pad_id, u, d)
    _segment_sum_kernel[grid](*args, CH=_CH, BC=_BC, W=_WALK, num_warps=_WARPS)
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
