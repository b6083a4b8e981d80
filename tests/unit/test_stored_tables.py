"""The tables of answers from a checkpoint's node state (:mod:`sven.tasks.stored`).

A local neighbour index over a few nodes samples what the run's index of the whole
stream samples for them; query times are placed in the store's time column without a
copy of it, as a float64 search would place them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sven.pipeline.negatives import root_keys
from sven.pipeline.sampler import TCSR, TemporalSampler
from sven.tasks.stored import LocalSampler, events_before, incident_entries


def _events(times: np.ndarray) -> SimpleNamespace:
    """A stream of 300 events over 40 nodes: self-loops, repeated pairs, ties in time."""
    rng = np.random.default_rng(11)
    e = times.size
    src = rng.integers(0, 40, e).astype(np.int32)
    dst = rng.integers(0, 40, e).astype(np.int32)
    dst[::17] = src[::17]  # self-loops: listed twice under their node
    return SimpleNamespace(src=src, dst=dst, t=times)


def test_incident_entries_hand_built() -> None:
    ev = SimpleNamespace(src=np.array([0, 2, 3, 2]), dst=np.array([1, 2, 0, 4]),
                         t=np.array([1, 2, 3, 4]))  # fmt: skip
    local, nbr, eid = incident_entries(ev, np.array([0, 2]))
    got = sorted(zip(local.tolist(), nbr.tolist(), eid.tolist()))
    # Node 0 (position 0): events 0 (to 1) and 2 (from 3); node 2: the self-loop twice,
    # then event 3 (to 4).
    assert got == [(0, 1, 0), (0, 3, 2), (1, 2, 1), (1, 2, 1), (1, 4, 3)]


@pytest.mark.parametrize("strategy", ["recent", "uniform"])
@pytest.mark.parametrize("floating", [False, True])
def test_local_sampler_draws_what_the_runs_sampler_draws(strategy, floating) -> None:
    rng = np.random.default_rng(3)
    times = np.sort(rng.integers(0, 60, 300))  # many ties
    times = times * 0.5 if floating else times
    ev = _events(times)
    full = TemporalSampler(TCSR.from_events(ev.src, ev.dst, ev.t, 40), [5], strategy)
    nodes = np.array([0, 3, 4, 17, 39], dtype=np.int64)
    local = LocalSampler(ev, nodes, 5, strategy, torch.device("cpu"))
    assert local.num_entries == full.tcsr.degree()[torch.from_numpy(nodes)].sum()
    # Roots: each node many times, at times before, between and after its events.
    roots = torch.from_numpy(np.repeat(nodes, 12))
    at = torch.from_numpy(rng.uniform(-1, 35, roots.numel()))
    keys = root_keys(0, 7, torch.arange(roots.numel()), 1)
    (want,) = full.sample(roots, at, keys=keys)
    (got,) = local.sample(roots, at, keys=keys)
    for field in ("nodes", "times", "nbr", "eid", "ts", "mask"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert want.mask.any() and not want.mask.all()
    with pytest.raises(Exception, match="outside the nodes"):
        local.sample(torch.tensor([1]), torch.tensor([10.0]))


def test_events_before_is_a_float64_search_without_a_copy() -> None:
    times = np.array([3, 5, 5, 5, 9, 12], dtype=np.int32)
    t = np.array([5.0, 5.5, 2.0, 12.0, 12.5, 1e30, -1e30, 9.0])
    want = np.searchsorted(times.astype(np.float64), t, side="left")
    np.testing.assert_array_equal(events_before(times, t), want)
    assert events_before(times, t).tolist() == [1, 4, 0, 5, 6, 6, 0, 4]
    assert events_before(np.zeros(0, dtype=np.int64), t).tolist() == [0] * t.size
