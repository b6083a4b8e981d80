"""Fixed-slot de-duplication (sven.pipeline.dedupe): the batch's node set in slots whose
number does not depend on the data."""

from __future__ import annotations

import torch

from sven.pipeline.dedupe import dedupe_fixed


def test_dedupe_fixed_is_unique_in_fixed_slots() -> None:
    ids = torch.tensor([5, 2, 5, 9, 2, 10, 0])
    nodes, inverse = dedupe_fixed(ids, 10)
    assert nodes.tolist() == [0, 2, 5, 9, 10, 10, 10]
    assert inverse.tolist() == [2, 1, 2, 3, 1, 4, 0]
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 30, (50,), generator=g)
        nodes, inverse = dedupe_fixed(ids, 30)
        u, inv = torch.unique(ids, return_inverse=True)
        assert torch.equal(nodes[: u.numel()], u) and (nodes[u.numel() :] == 30).all()
        assert torch.equal(inverse, inv) and torch.equal(nodes[inverse], ids)
    # Ids past int32 (sorted as int64) and just under it (sorted as int32).
    for pad in (2**31 - 1, 2**40):
        ids = torch.tensor([pad - 1, 7, pad, pad - 1, 2**30])
        nodes, inverse = dedupe_fixed(ids, pad)
        assert nodes.dtype == torch.int64
        assert nodes.tolist() == [7, 2**30, pad - 1, pad, pad]
        assert inverse.tolist() == [2, 0, 3, 2, 1]
