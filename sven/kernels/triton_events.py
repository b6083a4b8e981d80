"""A fixed-capacity batch's event slots and their columns as one Triton kernel.

For slot j of a batch of ``capacity`` slots over the events [start, stop): the event
``min(start + j, stop - 1)`` (padding repeats the last real event), through a rank's
``order`` where there is one, whether the slot is real (``start + j < stop``), and the
event's source, destination and time (as float64). The reference is
:func:`sven.pipeline.stages.select_events`'s own code (the CPU path): an ``arange``,
the comparisons and clamps, one gather per column and the time's conversion, about
nine kernels on CUDA where this is one, with the same values (int64 to float64 rounds
to nearest in both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sven.kernels.triton_hash import _scalar

__all__ = ["select_events"]

_BLOCK = 256


@triton.jit(do_not_specialize=["start", "stop", "B", "E"])
def _select_kernel(
    start, stop, order_ptr, src_ptr, dst_ptr, t_ptr,
    idx_ptr, valid_ptr, out_src_ptr, out_dst_ptr, out_t_ptr,
    B, E,
    START_PTR: tl.constexpr, STOP_PTR: tl.constexpr, HAS_ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < B
    if START_PTR:
        s = tl.load(start).to(tl.int64)
    else:
        s = start.to(tl.int64)
    if STOP_PTR:
        e = tl.load(stop).to(tl.int64)
    else:
        e = stop.to(tl.int64)
    i = s + j
    valid = i < e
    i = tl.minimum(i, e - 1)
    if HAS_ORDER:
        i = tl.load(order_ptr + tl.maximum(i, 0), mask=m, other=0)
    tl.store(idx_ptr + j, i, mask=m)
    tl.store(valid_ptr + j, valid.to(tl.int8), mask=m)
    # A negative event (an empty range at 0) counts from the end, as torch's indexing.
    i = tl.where(i < 0, i + E, i)
    tl.store(out_src_ptr + j, tl.load(src_ptr + i, mask=m, other=0), mask=m)
    tl.store(out_dst_ptr + j, tl.load(dst_ptr + i, mask=m, other=0), mask=m)
    tl.store(out_t_ptr + j, tl.load(t_ptr + i, mask=m, other=0).to(tl.float64), mask=m)


def select_events(
    src: torch.Tensor,
    dst: torch.Tensor,
    t: torch.Tensor,
    start: int | torch.Tensor,
    stop: int | torch.Tensor,
    capacity: int,
    order: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The event slots of a fixed-capacity batch and their columns, one kernel.

    Args:
        src: (E,) int64 sources (contiguous).
        dst: (E,) int64 destinations.
        t: (E,) int64 or float64 times.
        start: First index (int, or a 0-d int64 tensor on the tables' device).
        stop: One past the last index.
        capacity: B, the slots.
        order: (O,) int64 global events that ``start`` and ``stop`` index, or None.

    Returns:
        idx (B,) int64 global events, valid (B,) bool, src (B,), dst (B,) and t (B,)
        float64 of the events.
    """
    dev = src.device
    idx = torch.empty(capacity, dtype=torch.int64, device=dev)
    valid = torch.empty(capacity, dtype=torch.bool, device=dev)
    out_src = torch.empty(capacity, dtype=src.dtype, device=dev)
    out_dst = torch.empty(capacity, dtype=dst.dtype, device=dev)
    out_t = torch.empty(capacity, dtype=torch.float64, device=dev)
    if capacity == 0:
        return idx, valid, out_src, out_dst, out_t
    s, s_ptr = _scalar(start, dev)
    e, e_ptr = _scalar(stop, dev)
    _select_kernel[(triton.cdiv(capacity, _BLOCK),)](
        s, e, src if order is None else order, src, dst, t,
        idx, valid.view(torch.int8), out_src, out_dst, out_t,
        capacity, src.numel(),
        START_PTR=s_ptr, STOP_PTR=e_ptr, HAS_ORDER=order is not None, BLOCK=_BLOCK,
    )  # fmt: skip
    return idx, valid, out_src, out_dst, out_t
