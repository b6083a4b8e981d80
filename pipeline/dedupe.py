"""De-duplication of a batch's node ids into fixed-size slots.

``torch.unique`` returns as many ids as there are distinct ones, a size the host must
read back before anything downstream can be allocated, which breaks CUDA-graph capture
and costs a synchronisation per batch. Here the output has as many slots as the input:
the distinct ids fill the first slots in ascending order (exactly ``torch.unique``'s
output) and the remaining slots hold a padding id (the memory's scratch row), so every
shape depends only on the batch capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sven import kernels
from sven.kernels import ahead

__all__ = ["SortedRuns", "dedupe_counted", "dedupe_fixed", "dedupe_sorted", "slot_count"]


@dataclass
class SortedRuns:
    """A de-duplication's sort, kept for the backward of the batch's row gathers
    (:mod:`sven.kernels.triton_gather`): run by run, the positions that read each slot.

    Attributes:
        perm: (S,) int64 the sort's permutation of the S ids (``ids[perm]`` ascending).
        inverse: (S,) int64 the slot of each id.
        sorted_ids: (S,) int32 or int64 the ids in the sort's order, ``ids[perm]``.
        pad_id: The padding id (masked neighbour slots).
        nbr_lo: Position of the first neighbour slot among the ids (the root count).
    """

    perm: torch.Tensor
    inverse: torch.Tensor
    sorted_ids: torch.Tensor
    pad_id: int
    nbr_lo: int


# The widest id list the one-program Triton compaction takes (a training batch); wider
# ones (MRR evaluation) run the reference's parallel kernels.
_COMPACT_MAX_IDS = 32768


def slot_count(num_ids: int, pad_id: int) -> int:
    """Slots that hold the distinct ids of ``num_ids`` ids in [0, pad_id], whatever
    their values: no more than there are ids, nor than there are possible ids.

    On a small graph (or a wide evaluation batch: 100 MRR negatives per event make 20k
    roots and 200k neighbour slots) the node count bounds the slots far below the id
    count, and every per-slot stage (the state gather, the memory updater, the node
    projections) computes on those slots only.
    """
    return min(num_ids, pad_id + 1)


#: Counting replaces the sort while the id space is at most this many times the list: a
#: radix sort of int32 keys with their positions makes four passes over the list, each
#: reading and writing both; counting makes one fill and one scan over the id space and
#: three passes over the list.
_COUNT_SPACE_RATIO = 4


def dedupe_fixed(
    ids: torch.Tensor, pad_id: int, slots: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dedupe_sorted`'s nodes and inverse, without the sort's permutation.

    Where the id space [0, pad_id] is at most four times the list (a wide evaluation
    batch on a graph of thousands of nodes: 226,600 ids of 9,228 possible with 100 MRR
    negatives), the ids are counted instead of sorted (:func:`dedupe_counted`): the same
    two tensors.
    """
    if pad_id + 1 <= _COUNT_SPACE_RATIO * ids.shape[0]:
        return dedupe_counted(ids, pad_id, slots)
    nodes, inverse, _, _ = dedupe_sorted(ids, pad_id, slots)
    return nodes, inverse


def dedupe_counted(
    ids: torch.Tensor, pad_id: int, slots: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dedupe_fixed` by counting: a flag per possible id, their running sum.

    Args:
        ids: (S,) int64 node ids in [0, pad_id].
        pad_id: The padding id (see :func:`dedupe_sorted`).
        slots: U, as :func:`dedupe_sorted`'s.

    Returns:
        nodes (U,) and inverse (S,), equal to :func:`dedupe_sorted`'s: slot j holds the
        j-th smallest distinct id, so the running count of the ids present below an id
        is its slot.
    """
    u = ids.shape[0] if slots is None else slots
    present = torch.zeros(pad_id + 1, dtype=torch.int32, device=ids.device)
    present.index_fill_(0, ids, 1)
    slot_of = torch.cumsum(present, 0, dtype=torch.int64) - 1
    inverse = slot_of[ids]
    # Every occurrence of an id writes that id into its slot: the result is order-free.
    nodes = torch.full((u,), pad_id, dtype=ids.dtype, device=ids.device)
    nodes.scatter_(0, inverse, ids)
    return nodes, inverse


def dedupe_sorted(
    ids: torch.Tensor, pad_id: int, slots: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct ids in fixed slots, and each input's slot.

    Args:
        ids: (S,) int64 node ids in [0, pad_id] (pad_id may itself occur, e.g. for
            masked neighbour slots).
        pad_id: The id that fills unused slots; larger than every real id, so that the
            used slots stay sorted.
        slots: U, the number of output slots: S by default; at least the number of
            distinct ids (``min(S, pad_id + 1)`` always holds them all, since the ids
            lie in [0, pad_id]).

    Returns:
        nodes (U,): the sorted distinct ids, then ``pad_id`` in every unused slot;
        inverse (S,): the slot of each input, ``nodes[inverse] == ids``. For the slots
        in use both equal ``torch.unique(ids, return_inverse=True)``;
        perm (S,) int64: the sort's permutation, ``ids[perm]`` ascending (equal ids in
        a fixed order); sorted_ids (S,): ``ids[perm]`` (int32 where ``pad_id`` fits).

    Example:
        >>> dedupe_sorted(torch.tensor([5, 2, 5, 9]), 10)[:2]
        (tensor([ 2,  5,  9, 10]), tensor([1, 0, 1, 2]))
    """
    u = ids.shape[0] if slots is None else slots
    if kernels.backend_for(ids, "dedupe_sort") == "triton":
        from sven.kernels.triton_dedupe import dedupe_sort, sort_fits

        if sort_fits(ids.shape[0], pad_id):
            # A batch's list: the sort and the compaction in one program, where the
            # radix sort alone is some fifteen kernels.
            out = dedupe_sort(ids, pad_id, u)
            if not ahead.dry_running():
                return out
    if pad_id < 2**31:
        # Sorted as int32: a radix sort does half the passes of an int64 one (4 of 8 on
        # CUDA, the step's largest kernels after the GEMMs), for the same order.
        sorted_ids, perm = torch.sort(ids.to(torch.int32), stable=True)
    else:
        sorted_ids, perm = torch.sort(ids, stable=True)
    if ids.shape[0] <= _COMPACT_MAX_IDS and kernels.backend_for(ids, "dedupe_compact") == "triton":
        from sven.kernels.triton_dedupe import compact_sorted

        # One kernel for what follows the sort (the same two outputs).
        nodes, inverse = compact_sorted(sorted_ids, perm, pad_id, u)
        if ahead.dry_running():
            nodes, inverse = _compact(sorted_ids.to(ids.dtype), perm, pad_id, u)
        return nodes, inverse, perm, sorted_ids
    if pad_id < 2**31:
        sorted_ids = sorted_ids.to(ids.dtype)
    return (*_compact(sorted_ids, perm, pad_id, u), perm, sorted_ids)


def _compact(
    sorted_ids: torch.Tensor, perm: torch.Tensor, pad_id: int, u: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u,) unique ids padded with ``pad_id`` and the (S,) inverse, from the (S,) sorted
    ids and the sort's permutation (:func:`dedupe_sorted`'s reference after its sort)."""
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = torch.cumsum(first, 0) - 1
    # perm is a permutation, so these scatters write each target once.
    inverse = torch.empty_like(slot).scatter_(0, perm, slot)
    # Duplicate ids write the same value into their slot: the result is order-free.
    nodes = torch.full((u,), pad_id, dtype=sorted_ids.dtype, device=sorted_ids.device)
    nodes.scatter_(0, slot, sorted_ids)
    return nodes, inverse
