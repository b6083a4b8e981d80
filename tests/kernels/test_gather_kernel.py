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


def _shuffled_runs(lengths: list[int], pad: int, pad_count: int, gen: torch.Generator):
    """Ids 1, 4, 7, .. repeated by ``lengths`` (in that sorted order), then ``pad_count``
    padding ids, in a random order."""
    real = torch.arange(len(lengths)) * 3 + 1
    ids = torch.cat([real.repeat_interleave(torch.tensor(lengths)), torch.full((pad_count,), pad)])
    return ids[torch.randperm(ids.shape[0], generator=gen)]


def _index_add(g, inverse, nodes, pad, lo, slots, dtype):
    """The reference: rows of ``g`` added into their slots in position order; the
    padding's slot zero."""
    want = torch.zeros(slots, g.shape[1], dtype=dtype)
    want.index_add_(0, inverse[lo : lo + g.shape[0]].cpu(), g.cpu().to(dtype))
    want[nodes.cpu() == pad] = 0.0
    return want


def _boundary_lengths() -> list[int]:
    """Runs placed against the kernel's chunk (CH) and walk tile (W): one from a
    chunk's last entry for exactly one tile past it, one from a chunk's first entry
    over three tiles, single entries, runs of a chunk, and a long run at the end."""
    from sven.kernels.triton_gather import _CH, _WALK

    ch, w = _CH, _WALK
    return [ch - 1, 1 + w, 2 * w + ch + 5, 1, ch, ch, 1, 3 * w + 7, 2, ch + 1, 5, 600]


@pytest.mark.parametrize("d", [3, 40])
@pytest.mark.parametrize("pad_count", [0, 2500])
def test_runs_across_chunks_and_walk_tiles(device, d, pad_count):
    """Hub runs over many chunks, runs across chunk and walk-tile boundaries, a padding
    run of thousands, more slots than distinct ids: integer gradients give indexing's
    sums to the bit; the padding's rows are never read (their gradient may be anything)
    and its slot, like the unused ones, is zero."""
    from sven.kernels.triton_gather import segment_sum

    gen = torch.Generator().manual_seed(d + pad_count)
    pad = 10_000
    ids = _shuffled_runs(_boundary_lengths(), pad, pad_count, gen).to(device)
    s = ids.shape[0]
    distinct = len(_boundary_lengths()) + (pad_count > 0)
    nodes, inverse, perm, sorted_ids = dedupe_sorted(ids, pad, distinct + 37)
    for lo, n in ((0, 700), (700, s - 700)):
        g = torch.randint(-8, 9, (n, d), generator=gen).float()
        want = _index_add(g, inverse, nodes, pad, lo, distinct + 37, torch.float32)
        g[(ids[lo : lo + n] == pad).cpu()] = 1e30
        got = segment_sum(g.to(device), perm, inverse, sorted_ids, pad, lo, distinct + 37)
        assert torch.equal(got.cpu(), want), (lo, n)


def test_float_sums_close_and_repeatable(device):
    """Random float gradients in a Wikipedia-like list (a few hundred ids, hubs of
    hundreds of reads, a long padding run): within float32 rounding of a float64
    index_add, and two calls equal to the bit."""
    from sven.kernels.triton_gather import segment_sum

    gen = torch.Generator().manual_seed(3)
    pad, r = 9000, 300
    lengths = [*torch.randint(1, 6, (150,), generator=gen).tolist(), 450, 120, 260]
    ids = _shuffled_runs(lengths, pad, 1800, gen)
    ids = torch.cat([ids[ids != pad][:r], ids[r:]]).to(device)  # roots are real ids
    s = ids.shape[0]
    nodes, inverse, perm, sorted_ids = dedupe_sorted(ids, pad)
    g = torch.randn(s - r, 24, generator=gen)
    g[(ids[r:] == pad).cpu()] = 0.0
    want = _index_add(g, inverse, nodes, pad, r, s, torch.float64)
    g = g.to(device)
    got = segment_sum(g, perm, inverse, sorted_ids, pad, r, s)
    again = segment_sum(g, perm, inverse, sorted_ids, pad, r, s)
    assert torch.equal(got, again)
    assert torch.allclose(got.cpu().double(), want, rtol=1e-5, atol=1e-4)
    assert not got[len(lengths) :].any()
