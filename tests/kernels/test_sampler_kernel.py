"""The Triton "recent" sampler against the reference path of ``TemporalSampler``."""

from __future__ import annotations

import pytest
import torch

from sven.pipeline.sampler import TCSR, TemporalSampler, search_steps


def _blocks(use, sampler: TemporalSampler, backend: str, nodes, times, valid):
    """The sampler's layers with ``sample_recent`` on ``backend``."""
    use("sample_recent", backend)
    return sampler.sample(nodes, times, root_mask=valid)


def _same(got, want) -> None:
    for g, w in zip(got, want):
        for name in ("nodes", "times", "nbr", "eid", "ts", "mask", "age"):
            a, b = getattr(g, name), getattr(w, name)
            if a is None and b is None:
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), name


def test_search_steps() -> None:
    """Halvings that cover the widest segment: a segment of w entries needs
    bit_length(w) of them."""
    assert search_steps(torch.tensor([0])) == 0
    assert search_steps(torch.tensor([0, 0, 0])) == 0
    assert search_steps(torch.tensor([0, 1, 1])) == 1
    assert search_steps(torch.tensor([0, 3, 10])) == 3
    assert search_steps(torch.tensor([0, 8])) == 4


def test_recent_by_hand(device: str, use_kernel) -> None:
    """Node 0's events at times 1, 2, 2, 5 (ids 0..3 with nodes 1, 2, 1, 3): at time 2
    only the event at 1 is before; at 5.5 all four, latest first, K = 3 of them; the
    padding id (N = 4) and a root marked invalid get none."""
    src = torch.tensor([0, 0, 1, 0])
    dst = torch.tensor([1, 2, 0, 3])
    t = torch.tensor([1.0, 2.0, 2.0, 5.0], dtype=torch.float64)
    tcsr = TCSR.from_events(src, dst, t, 4, device=device)
    sampler = TemporalSampler(tcsr, [3], "recent")
    nodes = torch.tensor([0, 0, 4, 0, 3], device=device)
    times = torch.tensor([2.0, 5.5, 9.0, 9.0, 5.0], dtype=torch.float64, device=device)
    valid = torch.tensor([True, True, True, False, True], device=device)
    (got,) = _blocks(use_kernel, sampler, "triton", nodes, times, valid)
    assert got.nbr.tolist() == [[1, 0, 0], [3, 1, 2], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert got.eid.tolist() == [[0, 0, 0], [3, 2, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert got.ts.tolist() == [[1, 0, 0], [5, 2, 2], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert got.mask.tolist() == [
        [True, False, False],
        [True, True, True],
        [False, False, False],
        [False, False, False],
        [False, False, False],
    ]
    _same([got], _blocks(use_kernel, sampler, "reference", nodes, times, valid))


@pytest.mark.parametrize("float_times", [False, True])
@pytest.mark.parametrize("fanouts", [[1], [10], [5, 3]])
def test_recent_matches_reference(
    device: str, use_kernel, float_times: bool, fanouts: list[int]
) -> None:
    """Random graphs with hubs and silent nodes, roots at event times and between them
    (float roots over integer times round up), some invalid, two layers: the same
    integers as the reference, slot for slot."""
    gen = torch.Generator().manual_seed(len(fanouts) * 10 + fanouts[0] + float_times)
    n, e = 50, 400
    src = torch.randint(0, n, (e,), generator=gen)
    src[:100] = 7  # a hub, wider than any K
    dst = torch.randint(0, n - 5, (e,), generator=gen)  # nodes 45..49 only as sources
    t = torch.sort(torch.randint(0, 60, (e,), generator=gen)).values
    if float_times:
        t = t.to(torch.float64) / 3
    tcsr = TCSR.from_events(src, dst, t, n, device=device)
    sampler = TemporalSampler(tcsr, fanouts, "recent")
    r = 300
    nodes = torch.randint(0, n + 1, (r,), generator=gen)  # n: the padding id
    times = torch.rand(r, generator=gen, dtype=torch.float64) * 70
    valid = torch.rand(r, generator=gen) < 0.9
    args = (nodes.to(device), times.to(device), valid.to(device))
    _same(
        _blocks(use_kernel, sampler, "triton", *args),
        _blocks(use_kernel, sampler, "reference", *args),
    )
    _same(
        _blocks(use_kernel, sampler, "triton", args[0], args[1], None),
        _blocks(use_kernel, sampler, "reference", args[0], args[1], None),
    )


@pytest.mark.parametrize("float_times", [False, True])
def test_recent_writes_ids_and_ages(device: str, use_kernel, float_times: bool) -> None:
    """The id list's tail (the padding id where masked) and the ages (float64 root
    time as given minus the entry's, 0 where masked), float roots over integer times
    rounded up inside the kernel: the reference's, bit for bit."""
    gen = torch.Generator().manual_seed(5 + float_times)
    n, e, r, k = 30, 200, 97, 4
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n, (e,), generator=gen)
    t = torch.sort(torch.randint(0, 50, (e,), generator=gen)).values
    if float_times:
        t = t.to(torch.float64) / 7
    sampler = TemporalSampler(TCSR.from_events(src, dst, t, n, device=device), [k], "recent")
    nodes = torch.randint(0, n + 1, (r,), generator=gen).to(device)
    times = (torch.rand(r, generator=gen, dtype=torch.float64) * 60).to(device)
    valid = (torch.rand(r, generator=gen) < 0.8).to(device)
    got = {}
    for backend in ("triton", "reference"):
        use_kernel("sample_recent", backend)
        ids = torch.full((r * k + 3,), -7, dtype=torch.int64, device=device)
        blocks = sampler.sample(nodes, times, root_mask=valid, ids=ids[3:], pad_id=n, age=True)
        got[backend] = (blocks, ids)
    _same(got["triton"][0], got["reference"][0])
    assert torch.equal(got["triton"][1], got["reference"][1])
    (block,), ids = got["reference"]
    assert ids[:3].tolist() == [-7, -7, -7]
    want = torch.where(block.mask, block.nbr, n)
    assert torch.equal(ids[3:].view(r, k), want)
    age = torch.where(block.mask, times[:, None] - block.ts.to(torch.float64), 0.0)
    assert block.age.dtype == torch.float64 and torch.equal(block.age, age)
