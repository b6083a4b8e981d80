"""The one-kernel event slots of a fixed-capacity batch against the reference path of
``sven.pipeline.stages.select_events``."""

from __future__ import annotations

import pytest
import torch

from sven.pipeline.stages import EventTables, select_events


def _tables(device: str, float_times: bool) -> EventTables:
    gen = torch.Generator().manual_seed(3)
    e = 41
    t = torch.sort(torch.randint(0, 1000, (e,), generator=gen)).values
    if float_times:
        t = t.to(torch.float64) / 3
    return EventTables(
        src=torch.randint(0, 20, (e,), generator=gen).to(device),
        dst=torch.randint(0, 20, (e,), generator=gen).to(device),
        t=t.to(device),
        edge_feat=None,
        node_feat=None,
        candidates=torch.arange(20, device=device),
        sampler=None,
        num_nodes=20,
    )


def _both(use_kernel, tables, *args):
    got = {}
    for backend in ("triton", "reference"):
        use_kernel("select_events", backend)
        got[backend] = select_events(tables, *args)
    return got["triton"], got["reference"]


@pytest.mark.parametrize("float_times", [False, True])
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize(("start", "stop", "capacity"), [(0, 8, 8), (5, 9, 8), (38, 41, 300)])
def test_select_events_matches_reference(
    device: str, use_kernel, float_times, as_tensor, start, stop, capacity
) -> None:
    """Full and padded ranges (padding repeats the last event), bounds as ints or as
    the captured step's device scalars: the same slots, mask and columns, t as float64."""
    tables = _tables(device, float_times)
    if as_tensor:
        start, stop = torch.tensor(start, device=device), torch.tensor(stop, device=device)
    got, want = _both(use_kernel, tables, start, stop, capacity, None)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert got[4].dtype == torch.float64
    n = int(stop) - int(start)
    assert got[1].tolist() == [j < n for j in range(capacity)]
    assert got[0].tolist() == [int(start) + min(j, n - 1) for j in range(capacity)]


@pytest.mark.parametrize(("start", "stop"), [(2, 6), (4, 4), (0, 0)])
def test_select_events_through_an_order(device: str, use_kernel, start, stop) -> None:
    """A rank's share through its ``order``, an empty share included (it repeats an
    earlier entry of the order, or its first): the reference's slots and columns."""
    tables = _tables(device, False)
    order = torch.tensor([3, 9, 10, 17, 30, 31, 40, 0], device=device)
    got, want = _both(use_kernel, tables, start, stop, 5, order)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_an_empty_range_at_zero_reads_as_torch_indexes(device: str, use_kernel) -> None:
    """Without an order, an empty range at 0 names event -1, which torch's indexing
    reads from the end: the kernel reads the same row."""
    tables = _tables(device, True)
    got, want = _both(use_kernel, tables, 0, 0, 3, None)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert got[0].tolist() == [-1, -1, -1]


def _leaves(obj, prefix=""):
    """(name, tensor) of every tensor field of a batch, nested blocks included."""
    import dataclasses

    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            yield prefix + f.name, v
        elif dataclasses.is_dataclass(v):
            yield from _leaves(v, prefix + f.name + ".")


@pytest.mark.parametrize("sample_roots", ["all", "positive"])
def test_fixed_batch_with_kernels_matches_reference(
    device: str, use_kernel, sample_roots: str
) -> None:
    """A padded fixed-slot batch built with the event slots and the sampler (its id
    list and ages) on Triton equals the reference's, tensor for tensor."""
    from sven.pipeline.sampler import TCSR, TemporalSampler
    from sven.pipeline.stages import select_batch

    tables = _tables(device, False)
    tables.sampler = TemporalSampler(
        TCSR.from_events(tables.src, tables.dst, tables.t, 20, device=device), [3], "recent"
    )
    start, stop = torch.tensor(30, device=device), torch.tensor(37, device=device)
    got = {}
    for backend in ("triton", "reference"):
        use_kernel("select_events", backend, sample_recent=backend)
        batch = select_batch(
            tables, start, stop, torch.tensor(2, device=device), seed=5, num_neg=2,
            sample_roots=sample_roots, read_neighbors=True, capacity=9,
        )  # fmt: skip
        got[backend] = dict(_leaves(batch))
    assert got["triton"].keys() == got["reference"].keys()
    assert got["triton"]["block.age"].dtype == torch.float64
    for name, want in got["reference"].items():
        a = got["triton"][name]
        assert a.dtype == want.dtype and a.shape == want.shape, name
        assert torch.equal(a, want), name
