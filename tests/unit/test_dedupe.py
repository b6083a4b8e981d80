"""Fixed-slot de-duplication (sven.pipeline.dedupe): the batch's node set in slots whose
number does not depend on the data."""

from __future__ import annotations

import torch

from sven.pipeline.dedupe import dedupe_counted, dedupe_fixed, dedupe_sorted


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


def test_counting_gives_the_sorts_slots() -> None:
    # Lists wider and narrower than the id space, the padding id among them or not,
    # slots planned below the list's length (at least the distinct ids).
    for seed, (n, space, pad_in) in enumerate(
        [(200, 30, True), (200, 30, False), (64, 256, True), (1, 5, False), (300, 3, True)]
    ):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, space, (n,), generator=g)
        if pad_in:
            ids[::7] = space
        for slots in (None, int(torch.unique(ids).numel()), min(n, space + 1)):
            want_nodes, want_inv, _, _ = dedupe_sorted(ids, space, slots)
            nodes, inverse = dedupe_counted(ids, space, slots)
            assert torch.equal(nodes, want_nodes) and torch.equal(inverse, want_inv)
            assert nodes.dtype == torch.int64 and inverse.dtype == torch.int64


def test_fixed_counts_only_where_the_id_space_is_narrow(monkeypatch) -> None:
    import sven.pipeline.dedupe as dedupe

    calls: list[int] = []
    counted = dedupe.dedupe_counted

    def spy(ids, pad_id, slots=None):
        calls.append(pad_id)
        return counted(ids, pad_id, slots)

    monkeypatch.setattr(dedupe, "dedupe_counted", spy)
    ids = torch.arange(10)
    dedupe.dedupe_fixed(ids, 39)  # 40 possible ids, 4 per listed one: counted
    dedupe.dedupe_fixed(ids, 40)  # 41: sorted
    assert calls == [39]
