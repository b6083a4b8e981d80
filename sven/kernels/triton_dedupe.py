"""De-duplication as one Triton kernel, after the sort or with it.

``pipeline.dedupe.dedupe_fixed`` sorts a batch's ids, then marks each run's first id,
numbers the runs with a prefix sum and scatters twice (each input's slot, each slot's
id) over a padding-filled output: about ten kernels on CUDA after the sort. Here
:func:`compact_sorted` is one program that walks the sorted ids in blocks with a running
count, and writes the same two outputs; :func:`dedupe_sort` also sorts, in the same
program, where the radix sort before it is some fifteen kernels. The reference (the
CPU path and the oracle) is ``dedupe_fixed`` itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["SORT_MAX_IDS", "compact_sorted", "dedupe_sort", "sort_fits"]

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


#: The longest id list :func:`dedupe_sort` takes: the whole list is one block of keys in
#: one program's registers, a bitonic sort of log2(block) * (log2(block) + 1) / 2
#: compare-and-swap rounds. A training batch's block (8,192 keys for 6,600 ids at batch
#: 200) fits 16 warps' registers; a block of 16,384 (an evaluation batch's 11,000 ids)
#: spills (docs/kernels.md), so evaluation keeps the radix sort until that block is
#: measured on the GPU.
SORT_MAX_IDS = 1 << 13


@triton.jit
def _sort_kernel(
    ids_ptr, sorted_ptr, perm_ptr, nodes_ptr, inverse_ptr, S, U, pad_id,
    BLOCK: tl.constexpr, POS_BITS: tl.constexpr, KEY: tl.constexpr, TOP: tl.constexpr,
):  # fmt: skip
    # One program: the ids, packed with their positions into distinct keys, sorted in
    # registers (equal ids keep their input order: the stable sort), then the
    # compaction of _compact_kernel on the sorted block.
    offs = tl.arange(0, BLOCK)
    m = offs < S
    x = tl.load(ids_ptr + offs, mask=m, other=0).to(KEY)
    # The lanes past S sort last: every id's key is below TOP.
    key = tl.sort(tl.where(m, (x << POS_BITS) | offs.to(KEY), TOP))
    sid = (key >> POS_BITS).to(sorted_ptr.dtype.element_ty)
    p = (key & ((1 << POS_BITS) - 1)).to(tl.int64)
    tl.store(perm_ptr + offs, p, mask=m)
    tl.store(sorted_ptr + offs, sid, mask=m)
    # Each sorted id's predecessor lives in another thread's registers: read it back
    # once every thread's store is visible to the program.
    tl.debug_barrier()
    before = tl.load(sorted_ptr + offs - 1, mask=m & (offs > 0), other=0)
    first = m & ((offs == 0) | (sid != before))
    slot = tl.cumsum(first.to(tl.int32), axis=0).to(tl.int64) - 1
    tl.store(inverse_ptr + p, slot, mask=m)
    tl.store(nodes_ptr + slot, sid.to(tl.int64), mask=first)
    seen = tl.sum(first.to(tl.int32), axis=0)
    pad = tl.zeros([BLOCK], tl.int64) + pad_id
    for start in range(0, U, BLOCK):
        o = start + offs
        tl.store(nodes_ptr + o, pad, mask=(o >= seen) & (o < U))


def _sort_layout(num_ids: int, pad_id: int) -> tuple[int, torch.dtype] | None:
    """(position bits, key dtype) of :func:`dedupe_sort`'s packed keys, None where the
    list is longer than :data:`SORT_MAX_IDS` or ``(pad_id + 1) << bits`` passes int64."""
    if num_ids > SORT_MAX_IDS:
        return None
    # At least 16 lanes: a sort of fewer is a reduction in Triton, not a permutation.
    bits = max(4, (num_ids - 1).bit_length())
    for dtype, width in ((torch.int32, 31), (torch.int64, 63)):
        # Below the top key, which fills the lanes past the list.
        if (pad_id + 1) << bits < 2**width - 1:
            return bits, dtype
    return None


def sort_fits(num_ids: int, pad_id: int) -> bool:
    """Whether :func:`dedupe_sort` takes ``num_ids`` ids in [0, pad_id]."""
    return _sort_layout(num_ids, pad_id) is not None


def dedupe_sort(
    ids: torch.Tensor, pad_id: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pipeline.dedupe.dedupe_sorted`` as one program: a bitonic sort of the ids
    packed with their positions (``id << k | position``), then the compaction.

    Args:
        ids: (S,) int64 ids in [0, pad_id], where :func:`sort_fits` (S, pad_id).
        pad_id: The id of the unused slots.
        slots: U, at least the number of distinct ids.

    Returns:
        nodes (U,) int64, inverse (S,) int64, perm (S,) int64 (stable: equal ids in input
        order) and sorted_ids (S,) (int32 where ``pad_id < 2**31``, else int64), as
        ``dedupe_sorted``.
    """
    s = ids.shape[0]
    layout = _sort_layout(s, pad_id)
    if layout is None:
        raise ValueError(f"dedupe_sort: {s} ids with pad_id {pad_id} do not fit (sort_fits)")
    bits, key = layout
    dev = ids.device
    nodes = torch.empty(slots, dtype=torch.int64, device=dev)
    inverse = torch.empty(s, dtype=torch.int64, device=dev)
    perm = torch.empty(s, dtype=torch.int64, device=dev)
    sorted_ids = torch.empty(s, dtype=torch.int32 if pad_id < 2**31 else ids.dtype, device=dev)
    if s:
        _sort_kernel[(1,)](
            ids, sorted_ids, perm, nodes, inverse, s, slots, pad_id,
            BLOCK=1 << bits, POS_BITS=bits, KEY=tl.int32 if key == torch.int32 else tl.int64,
            TOP=torch.iinfo(key).max, num_warps=_warps(bits),
        )  # fmt: skip
    elif slots:
        nodes.fill_(pad_id)
    return nodes, inverse, perm, sorted_ids


def _warps(bits: int) -> int:
    # 16 keys a thread: the most whose sort fits a thread's registers at 16 warps (512
    # threads, 128 registers each); a block past 8,192 keys spills.
    return min(16, max(4, (1 << bits) // 512))
