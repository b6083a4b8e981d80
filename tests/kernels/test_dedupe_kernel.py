"""The Triton de-duplications (the compaction after the sort, and the one-program sort
with it) against ``dedupe_fixed``'s reference path."""

from __future__ import annotations

import pytest
import torch

from sven.pipeline.dedupe import dedupe_fixed, dedupe_sorted


def _dedupe(use, backend: str, ids: torch.Tensor, pad_id: int, slots: int | None):
    # The compaction after a sort: not the program that also sorts.
    use("dedupe_compact", backend, dedupe_sort="reference")
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


def _sort_matches(use, ids: torch.Tensor, pad_id: int, slots: int | None) -> None:
    """The one-program sort's four outputs against the stable sort's: equal values, and
    the dtypes of the compaction path it replaces on CUDA (sorted ids int32 where the
    padding id fits)."""
    use("dedupe_sort", "triton")
    got = dedupe_sorted(ids, pad_id, slots)
    use("dedupe_sort", "reference", dedupe_compact="reference")
    want = dedupe_sorted(ids, pad_id, slots)
    use("dedupe_sort", "reference", dedupe_compact="triton")
    dtypes = [t.dtype for t in dedupe_sorted(ids, pad_id, slots)]
    for name, g, w, dtype in zip(("nodes", "inverse", "perm", "sorted_ids"), got, want, dtypes):
        assert g.dtype == dtype and torch.equal(g.long(), w.long()), name
    assert dtypes[3] == (torch.int32 if pad_id < 2**31 else torch.int64)


def test_sort_by_hand(device: str, use_kernel) -> None:
    """The docstring's example, and a stable order of equal ids (positions ascending)."""
    use_kernel("dedupe_sort", "triton")
    ids = torch.tensor([5, 2, 5, 9, 2, 5], device=device)
    nodes, inverse, perm, sorted_ids = dedupe_sorted(ids, 10, 7)
    assert nodes.tolist() == [2, 5, 9, 10, 10, 10, 10] and inverse.tolist() == [1, 0, 1, 2, 0, 1]
    assert perm.tolist() == [1, 4, 0, 2, 5, 3] and sorted_ids.tolist() == [2, 2, 5, 5, 5, 9]


@pytest.mark.parametrize(
    ("size", "pad_id", "slots"),
    [
        (1, 9227, None),
        (2, 9227, None),
        (31, 9227, None),
        (6600, 9227, None),
        pytest.param(8192, 9227, None, marks=pytest.mark.slow),
        pytest.param(8192, 9227, 9228, marks=pytest.mark.slow),
        (300, 2**31 - 2, None),
        (300, 2**31 + 5, None),
        (300, 2**40, 400),
    ],
)
def test_sort_matches_reference(device: str, use_kernel, size: int, pad_id: int, slots) -> None:
    """Random lists of a training batch's shape (some 450 distinct ids, 45% padding ids),
    the bound (8,192 ids; past it, ``test_sort_bound``), and padding ids whose packed
    keys need int64 (past int32 itself, and past int64's sorted ids): the stable sort's
    outputs exactly."""
    gen = torch.Generator().manual_seed(size + pad_id % 1000)
    pool = torch.randint(0, pad_id, (450,), generator=gen)
    ids = pool[torch.randint(0, 450, (size,), generator=gen)]
    ids[torch.rand(size, generator=gen) < 0.45] = pad_id
    _sort_matches(use_kernel, ids.to(device), pad_id, slots)


@pytest.mark.parametrize("order", ["equal", "sorted", "reversed", "distinct"])
def test_sort_orders(device: str, use_kernel, order: str) -> None:
    """Runs as long as the list, already sorted and reversed lists (with runs), and every
    id distinct, with more slots than distinct ids."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 60, (1000,), generator=gen)
    ids = {
        "equal": torch.full((1000,), 17),
        "sorted": ids.sort().values,
        "reversed": ids.sort(descending=True).values,
        "distinct": torch.randperm(1000, generator=gen),
    }[order]
    _sort_matches(use_kernel, ids.to(device), 1000, 1001)


def test_sort_bound(device: str, use_kernel) -> None:
    """Past the bound, or where packed keys pass int64, the radix sort answers instead."""
    from sven.kernels.triton_dedupe import SORT_MAX_IDS, sort_fits

    assert sort_fits(SORT_MAX_IDS, 9227) and not sort_fits(SORT_MAX_IDS + 1, 9227)
    assert sort_fits(16, 2**59 - 2) and not sort_fits(16, 2**59)
    ids = torch.arange(SORT_MAX_IDS + 1, device=device) % 7
    use_kernel("dedupe_sort", "triton", dedupe_compact="reference")
    nodes, inverse, perm, sorted_ids = dedupe_sorted(ids, 7, 8)
    assert nodes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and torch.equal(inverse, ids)
    assert sorted_ids.dtype == torch.int64 and torch.equal(sorted_ids, ids[perm])
