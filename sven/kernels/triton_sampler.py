"""The most-recent temporal neighbour sampler as one Triton kernel.

For each root (node v, time t) the kernel finds, by a binary search over v's own
segment of the T-CSR (sorted by time), the first entry at or after t, then writes the
K entries before it, most recent first, with their mask. The reference
(:class:`sven.pipeline.sampler.TemporalSampler`, the CPU path) finds the same cut with
two ``torch.searchsorted`` over a global (node, time rank) key and gathers with
fixed-shape index arithmetic: about seventeen kernels per layer on CUDA, where this is
one. Both give the same integers: the entries of v with ``ts < t``, the latest K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sven.kernels.strides import unaligned

__all__ = ["sample_recent"]

_BLOCK_R = 128


# R and pad_id only bound rows and fill masked slots, and the id list's tail starts
# where its roots end: the planner's many batches at once and the step's one would
# otherwise be compiled variants of their own.
@triton.jit(do_not_specialize=["R", "pad_id"], **unaligned("ids_ptr"))
def _recent_kernel(
    indptr_ptr, ts_ptr, nbr_ptr, eid_ptr, nodes_ptr, times_ptr, valid_ptr,
    out_nbr_ptr, out_eid_ptr, out_ts_ptr, out_mask_ptr, out_times_ptr, ids_ptr, age_ptr,
    R, N, K, steps, pad_id,
    HAS_VALID: tl.constexpr, CAST: tl.constexpr, HAS_IDS: tl.constexpr,
    HAS_AGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < R
    node = tl.load(nodes_ptr + r, mask=rm, other=0)
    given = tl.load(times_ptr + r, mask=rm, other=0)
    # The sampler's _cast_times: floating times over integer ts round up (ts < 5.5 is
    # ts < 6), integer times over floating ts convert.
    if CAST == 1:
        t = tl.math.ceil(given).to(ts_ptr.dtype.element_ty)
    elif CAST == 2:
        t = given.to(ts_ptr.dtype.element_ty)
    else:
        t = given
    tl.store(out_times_ptr + r, t, mask=rm)
    # Ids outside [0, N) (the padding id N) have no entries.
    real = rm & (node >= 0) & (node < N)
    lo = tl.load(indptr_ptr + node, mask=real, other=0)
    hi = tl.load(indptr_ptr + node + 1, mask=real, other=0)
    # Lower bound: the first entry of [lo, hi) with ts >= t; `steps` halvings cover the
    # largest segment.
    a = lo
    b = hi
    for _ in range(steps):
        active = a < b
        mid = (a + b) // 2
        v = tl.load(ts_ptr + mid, mask=active, other=0)
        right = active & (v < t)
        a = tl.where(right, mid + 1, a)
        b = tl.where(active & (v >= t), mid, b)
    count = a - lo
    if HAS_VALID:
        ok = tl.load(valid_ptr + r, mask=rm, other=0) != 0
        count = tl.where(ok, count, 0)
    slot = tl.arange(0, BLOCK_K)
    tile = rm[:, None] & (slot < K)[None, :]
    mask = tile & (slot[None, :] < count[:, None])
    pos = a[:, None] - 1 - slot[None, :]
    nbr = tl.load(nbr_ptr + pos, mask=mask, other=0)
    eid = tl.load(eid_ptr + pos, mask=mask, other=0)
    ts = tl.load(ts_ptr + pos, mask=mask, other=0)
    at = r[:, None] * K + slot[None, :]
    tl.store(out_nbr_ptr + at, nbr, mask=tile)
    tl.store(out_eid_ptr + at, eid, mask=tile)
    tl.store(out_ts_ptr + at, ts, mask=tile)
    tl.store(out_mask_ptr + at, mask.to(tl.int8), mask=tile)
    if HAS_IDS:
        tl.store(ids_ptr + at, tl.where(mask, nbr, pad_id), mask=tile)
    if HAS_AGE:
        age = given.to(tl.float64)[:, None] - ts.to(tl.float64)
        tl.store(age_ptr + at, tl.where(mask, age, 0.0), mask=tile)


def sample_recent(
    indptr: torch.Tensor,
    ts: torch.Tensor,
    nbr: torch.Tensor,
    eid: torch.Tensor,
    nodes: torch.Tensor,
    times: torch.Tensor,
    valid: torch.Tensor | None,
    k: int,
    steps: int,
    *,
    ids: torch.Tensor | None = None,
    pad_id: int = 0,
    age: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The K most recent entries strictly before each root's time, one kernel.

    Args:
        indptr: (N + 1,) int64 segment offsets of the T-CSR.
        ts: (2E,) entry times (int64 or float64), sorted within each segment.
        nbr: (2E,) int64 neighbour of each entry.
        eid: (2E,) int64 event id of each entry.
        nodes: (R,) int64 root ids; ids outside [0, N) have no neighbours.
        times: (R,) root times, any dtype: brought to ``ts``'s as the sampler's
            ``_cast_times`` does (floating times over integer ``ts`` rounded up).
        valid: (R,) bool, or None: roots marked False get no neighbours.
        k: K, the slots per root.
        steps: Halvings that cover the widest segment
            (``sven.pipeline.sampler.search_steps``).
        ids: (R * K,) int64 contiguous, or None: also written with the neighbour ids,
            ``pad_id`` where masked.
        pad_id: See ``ids``.
        age: Whether to return the neighbours' ages too.

    Returns:
        ``nbr`` (R, K) int64, ``eid`` (R, K) int64, ``ts`` (R, K) and ``mask`` (R, K)
        bool: slot j holds the (j + 1)-th latest candidate, zeros where masked; the
        (R,) times in ``ts``'s dtype; with ``age``, (R, K) float64 ``times`` (as given)
        minus ``ts``, 0 where masked.
    """
    r = nodes.numel()
    dev = nodes.device
    out_nbr = torch.empty(r, k, dtype=torch.int64, device=dev)
    out_eid = torch.empty(r, k, dtype=torch.int64, device=dev)
    out_ts = torch.empty(r, k, dtype=ts.dtype, device=dev)
    out_mask = torch.empty(r, k, dtype=torch.bool, device=dev)
    out_times = torch.empty(r, dtype=ts.dtype, device=dev)
    out_age = torch.empty(r, k, dtype=torch.float64, device=dev) if age else None
    outs = (out_nbr, out_eid, out_ts, out_mask, out_times, out_age)
    if r == 0:
        return outs
    if ts.dtype == times.dtype:
        cast = 0
    elif times.is_floating_point() and not ts.is_floating_point():
        cast = 1
    else:
        cast = 2
    grid = (triton.cdiv(r, _BLOCK_R),)
    _recent_kernel[grid](
        indptr, ts, nbr, eid, nodes, times, nodes if valid is None else valid.view(torch.uint8),
        out_nbr, out_eid, out_ts, out_mask.view(torch.int8), out_times,
        nodes if ids is None else ids, out_nbr if out_age is None else out_age,
        r, indptr.numel() - 1, k, steps, pad_id,
        HAS_VALID=valid is not None, CAST=cast, HAS_IDS=ids is not None, HAS_AGE=age,
        BLOCK_R=_BLOCK_R, BLOCK_K=max(2, triton.next_power_of_2(k)),
    )  # fmt: skip
    return outs
