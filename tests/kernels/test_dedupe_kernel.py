"""The Triton compaction after the sort against ``dedupe_fixed``'s reference path."""

from __future__ import annotations

import pytest
import torch

from sven.pipeline.dedupe import dedupe_fixed


def _dedupe(use, backend: str, ids: torch.Tensor, pad_id: int, slots: int | None):
    # The compaction after a sort: not the counting program small id ranges take.
    use("dedupe_compact", backend, dedupe_count="reference")
    return dedupe_fixed(ids, pad_id, slots)


def test_compact_by_hand(device: str, use_kernel) -> None:
    """The docstring's example: ids 5, 2, 5, 9 with padding id 10."""
    nodes, inverse = _dedupe(
        use_kernel, "triton", torch.tensor([5, 2, 5, 9], device=device), 10, None
    )
    assert nodes.tolist() == [2, 5, 9, 10] and inverse.tolist() == [1, 0, 1, 2]
    nodes, inverse = _dedupe(use_kernel, "triton", torch.tensor([3, 3, 3], device=device), 7, 2)
    assert nodes.tolist() == [3, 7] and inverse.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("size", "pad_id", "slots"),
    [(1, 0, None), (6600, 9227, None), (6600, 1899, 1900), (9000, 2**40, None), (4097, 50, 51)],
)
def test_compact_matches_reference(device: str, use_kernel, size: int, pad_id: int, slots) -> None:
    """Across block boundaries (4,096 ids per block), with the padding id among the ids,
    slots capped at N + 1, and int64 ids past int32: the reference's outputs exactly."""
    gen = torch.Generator().manual_seed(size)
    ids = torch.randint(0, min(pad_id, 2**62) + 1, (size,), generator=gen)
    ids[::7] = pad_id
    ids = ids.to(device)
    got = _dedupe(use_kernel, "triton", ids, pad_id, slots)
    want = _dedupe(use_kernel, "reference", ids, pad_id, slots)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.int64 and torch.equal(g, w)


@pytest.mark.parametrize(
    ("size", "pad_id", "slots", "distinct"),
    [
        (1, 0, None, 1),
        (3, 7, 2, 1),
        (129, 5, 6, 6),
        (6600, 9227, None, 3000),
        (6600, 1899, 1900, 1900),
        (5000, 60, 61, 61),
        (300, 65535, None, 50),
    ],
)
def test_count_matches_sorted_reference(
    device: str, use_kernel, size: int, pad_id: int, slots, distinct: int
) -> None:
    """The counting program against the stable sort: the same nodes, slots, permutation
    (equal ids in input order, runs crossing the program's 128-id blocks) and sorted ids."""
    from sven.pipeline.dedupe import dedupe_sorted

    gen = torch.Generator().manual_seed(size + pad_id)
    pool = torch.randperm(pad_id + 1, generator=gen)[:distinct]
    ids = pool[torch.randint(0, pool.numel(), (size,), generator=gen)]
    ids[::5] = pad_id
    ids = ids.to(device)
    use_kernel("dedupe_count", "triton")
    got = dedupe_sorted(ids, pad_id, slots)
    use_kernel("dedupe_count", "reference", dedupe_compact="reference")
    want = dedupe_sorted(ids, pad_id, slots)
    for name, g, w in zip(("nodes", "inverse", "perm", "sorted_ids"), got, want):
        assert torch.equal(g.long(), w.long()), name
    assert got[2].dtype == torch.int64 and got[0].dtype == torch.int64
