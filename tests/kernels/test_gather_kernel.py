"""The row gather whose backward sums over the de-duplication's runs
(``sven.kernels.triton_gather``) against plain indexing."""

from __future__ import annotations

import pytest
import torch

from sven.pipeline.dedupe import dedupe_sorted


def _layout(ids: torch.Tensor, pad: int, r: int):
    """The batch layout of ``make_batch``: roots' slots, and neighbours' slots with
    masked ones (the padding id) reading a row of their own."""
    nodes, inverse, perm, sorted_ids = dedupe_sorted(ids, pad)
    u = nodes.shape[0]
    own = torch.arange(r, ids.shape[0], device=ids.device) % u
    nbr = torch.where(ids[r:] != pad, inverse[r:], own)
    return nodes, inverse, (perm, inverse, sorted_ids), inverse[:r], nbr


def _grads(table, idx, g, gather):
    t = table.clone().requires_grad_(True)
    out = gather(t, idx)
    out.backward(g)
    return out.detach(), t.grad


def test_hand_built(device):
    """ids [5, 2, 5 | 9, 2, pad, 5, pad]: root rows 0..2, neighbour rows 3..7."""
    from sven.kernels.triton_gather import gather_rows_sorted

    pad = 10
    ids = torch.tensor([5, 2, 5, 9, 2, pad, 5, pad], device=device)
    nodes, _, runs, root_pos, nbr_pos = _layout(ids, pad, 3)
    assert nodes.tolist() == [2, 5, 9, 10, 10, 10, 10, 10]
    table = torch.arange(16.0, device=device).view(8, 2)
    g = torch.tensor([[1.0, 10.0], [2.0, 20.0], [4.0, 40.0]], device=device)
    out, grad = _grads(table, root_pos, g, lambda t, i: gather_rows_sorted(t, i, *runs, pad, 0))
    assert torch.equal(out, table[root_pos])
    # Slot 1 (id 5) is read by roots 0 and 2, slot 0 (id 2) by root 1.
    assert grad.tolist() == [[2, 20], [5, 50]] + [[0, 0]] * 6
    gn = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [8.0, 8.0], [0.0, 0.0]], device=device)
    out, grad = _grads(table, nbr_pos, gn, lambda t, i: gather_rows_sorted(t, i, *runs, pad, 3))
    assert torch.equal(out, table[nbr_pos])
    # id 9 (slot 2) by neighbour 0; id 2 (slot 0) by neighbour 1; id 5 (slot 1) by 3.
    assert grad.tolist() == [[2, 2], [8, 8], [1, 1]] + [[0, 0]] * 5


@pytest.mark.parametrize("d", [3, 64, 100, 200])
@pytest.mark.parametrize("side", ["roots", "neighbours"])
def test_equals_indexing_backward(device, d, side):
    """Long runs (a hub read 700 times, across many chunks), a long padding run, and
    integer gradients, so that any order of summation gives the same floats."""
    from sven.kernels.triton_gather import gather_rows_sorted

    g = torch.Generator().manual_seed(d)
    pad, r, s = 5000, 300, 3000
    ids = torch.randint(0, 400, (s,), generator=g)
    ids[torch.randperm(s, generator=g)[:700]] = 7
    masked = torch.zeros(s, dtype=torch.bool)
    masked[r:] = torch.rand(s - r, generator=g) < 0.3
    ids[masked] = pad
    ids = ids.to(device)
    nodes, _, runs, root_pos, nbr_pos = _layout(ids, pad, r)
    u = nodes.shape[0]
    table = torch.randn(u, d, generator=g).to(device)
    idx, lo = (root_pos, 0) if side == "roots" else (nbr_pos, r)
    grad_out = torch.randint(-4, 5, (idx.shape[0], d), generator=g).float().to(device)
    if side == "neighbours":
        # Masked slots receive no gradient (the masked attention's zeros).
        grad_out[masked[r:].to(device)] = 0.0
    want_out, want = _grads(table, idx, grad_out, lambda t, i: t[i])
    got_out, got = _grads(
        table, idx, grad_out, lambda t, i: gather_rows_sorted(t, i, *runs, pad, lo)
    )
    assert torch.equal(got_out, want_out)
    assert torch.equal(got, want)


def test_short_lists(device):
    """Fewer ids than a chunk, and one id only."""
    from sven.kernels.triton_gather import gather_rows_sorted

    for ids in ([3], [4, 4, 4], [2, 9, 2, 1]):
        t_ids = torch.tensor(ids, device=device)
        nodes, inverse, perm, sorted_ids = dedupe_sorted(t_ids, 99)
        table = torch.randn(nodes.shape[0], 5, device=device)
        gout = torch.ones(len(ids), 5, device=device)
        _, want = _grads(table, inverse, gout, lambda t, i: t[i])
        runs = (perm, inverse, sorted_ids)
        _, got = _grads(
            table, inverse, gout, lambda t, i, runs=runs: gather_rows_sorted(t, i, *runs, 99, 0)
        )
        assert torch.equal(got, want), ids
