"""Temporal sampler: exact values on a hand-built graph and a brute-force oracle.

The oracle loops over the events in Python, so it shares nothing with the vectorized
search it checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sven.pipeline.negatives import hash_counter
from sven.pipeline.sampler import TCSR, NeighborBlock, TemporalSampler

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
    ),
]

# Hand-built graph, N = 5 (node 4 has no events). eid: (src, dst, t)
#   0: (0, 1, 1)   1: (0, 2, 2)   2: (1, 2, 2)   3: (0, 1, 3)   4: (2, 2, 4) self-loop
#   5: (0, 3, 5)
HAND_SRC = [0, 0, 1, 0, 2, 0]
HAND_DST = [1, 2, 2, 1, 2, 3]
HAND_T = [1, 2, 2, 3, 4, 5]


def hand_tcsr(device: str) -> TCSR:
    return TCSR.from_events(
        torch.tensor(HAND_SRC), torch.tensor(HAND_DST), torch.tensor(HAND_T), 5, device
    )


def tensors(block: NeighborBlock) -> dict[str, list]:
    return {name: getattr(block, name).cpu().tolist() for name in ("nbr", "eid", "ts", "mask")}


# --- oracle -------------------------------------------------------------------------


def oracle_candidates(src, dst, t, v, time) -> list[tuple]:
    """(ts, eid, nbr) of every entry of node v strictly before ``time``, in any order."""
    out = []
    for e in range(len(src)):
        if t[e] < time:
            # Two independent ifs: a self-loop is listed twice.
            if src[e] == v:
                out.append((t[e], e, dst[e]))
            if dst[e] == v:
                out.append((t[e], e, src[e]))
    return out


def oracle_recent(src, dst, t, nodes, times, valid, k):
    """Expected nbr, eid, ts, mask lists for one layer of "recent" sampling."""
    rows = {"nbr": [], "eid": [], "ts": [], "mask": []}
    for v, time, ok in zip(nodes, times, valid):
        cands = sorted(oracle_candidates(src, dst, t, v, time), reverse=True)[:k] if ok else []
        pad = k - len(cands)
        rows["ts"].append([c[0] for c in cands] + [0] * pad)
        rows["eid"].append([c[1] for c in cands] + [0] * pad)
        rows["nbr"].append([c[2] for c in cands] + [0] * pad)
        rows["mask"].append([True] * len(cands) + [False] * pad)
    return rows


# --- T-CSR --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_tcsr_hand_built(device):
    g = hand_tcsr(device)
    assert g.indptr.tolist() == [0, 4, 7, 11, 12, 12]
    assert g.nbr.tolist() == [1, 2, 1, 3, 0, 2, 0, 0, 1, 2, 2, 0]
    assert g.eid.tolist() == [0, 1, 3, 5, 0, 2, 3, 1, 2, 4, 4, 5]
    assert g.ts.tolist() == [1, 2, 3, 5, 1, 2, 3, 2, 2, 4, 4, 5]
    assert g.degree().tolist() == [4, 3, 4, 1, 0]
    assert g.num_nodes == 5 and g.num_entries == 12
    assert g.ts.dtype == torch.int64 and g.nbr.dtype == g.eid.dtype == torch.int64
    assert g.indptr.device.type == device


def test_tcsr_unsorted_input_matches_sorted():
    # Keeps events 1 and 2 (tied at t=2) in the same relative order, since ties are
    # broken by the new event ids.
    perm = [5, 1, 0, 4, 2, 3]
    g = TCSR.from_events(
        np.array(HAND_SRC)[perm], np.array(HAND_DST)[perm], np.array(HAND_T)[perm], 5
    )
    ref = hand_tcsr("cpu")
    assert torch.equal(g.indptr, ref.indptr)
    assert torch.equal(g.ts, ref.ts) and torch.equal(g.nbr, ref.nbr)
    # Event ids are positions in the given arrays, so they follow the permutation.
    assert torch.equal(torch.tensor(perm)[g.eid], ref.eid)


def test_tcsr_from_int32_memmap(tmp_path):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 30, 200).astype(np.int32)
    dst = rng.integers(0, 30, 200).astype(np.int32)
    for t in (np.sort(rng.integers(0, 50, 200)), np.sort(rng.random(200) * 10)):
        for name, col in (("src", src), ("dst", dst), ("t", t)):
            np.save(tmp_path / f"{name}.npy", col)
        cols = [np.load(tmp_path / f"{n}.npy", mmap_mode="r") for n in ("src", "dst", "t")]
        g = TCSR.from_events(*cols, num_nodes=30)
        ref = TCSR.from_events(torch.from_numpy(src), torch.from_numpy(dst), torch.tensor(t), 30)
        assert g.ts.dtype == (torch.float64 if t.dtype.kind == "f" else torch.int64)
        for name in ("indptr", "nbr", "eid", "ts"):
            assert torch.equal(getattr(g, name), getattr(ref, name)), name


def test_tcsr_to_device_roundtrip():
    g = hand_tcsr("cpu")
    assert g.to("cpu") is g
    if CUDA:
        back = g.to("cuda").to("cpu")
        assert torch.equal(back.nbr, g.nbr) and torch.equal(back.indptr, g.indptr)


def test_tcsr_rejects_bad_input():
    with pytest.raises(ValueError, match="outside"):
        TCSR.from_events(np.array([0, 5]), np.array([1, 1]), np.array([0, 1]), 5)
    with pytest.raises(ValueError, match="outside"):
        TCSR.from_events(np.array([0, -1]), np.array([1, 1]), np.array([0, 1]), 5)
    with pytest.raises(ValueError, match="length"):
        TCSR.from_events(np.array([0, 1]), np.array([1]), np.array([0, 1]), 5)
    with pytest.raises(ValueError, match="NaN"):
        TCSR.from_events(np.array([0]), np.array([1]), np.array([np.nan]), 5)


def test_sampler_rejects_bad_config():
    g = hand_tcsr("cpu")
    with pytest.raises(ValueError, match="strategy"):
        TemporalSampler(g, [2], strategy="latest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fanouts"):
        TemporalSampler(g, [])
    with pytest.raises(ValueError, match="fanouts"):
        TemporalSampler(g, [3, 0])


# --- recent: exact values -------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_recent_hand_built(device):
    sampler = TemporalSampler(hand_tcsr(device), [3], strategy="recent")
    nodes = torch.tensor([0, 2, 2, 1, 4, 3], device=device)
    times = torch.tensor([5, 5, 4, 1, 10, 6], device=device)
    (block,) = sampler.sample(nodes, times)
    assert tensors(block) == {
        # (0, 5): e3, e1, e0 (e5 at t=5 is not strictly before).
        # (2, 5): the self-loop e4 twice, then e2 (ties at t=2 go to the larger eid).
        # (2, 4): e2, e1; the self-loop at t=4 is excluded.
        # (1, 1): e0 is at t=1 exactly, so nothing. (4, 10): no events. (3, 6): e5.
        "nbr": [[1, 2, 1], [2, 2, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
        "eid": [[3, 1, 0], [4, 4, 2], [2, 1, 0], [0, 0, 0], [0, 0, 0], [5, 0, 0]],
        "ts": [[3, 2, 1], [4, 4, 2], [2, 2, 0], [0, 0, 0], [0, 0, 0], [5, 0, 0]],
        "mask": [
            [True, True, True],
            [True, True, True],
            [True, True, False],
            [False, False, False],
            [False, False, False],
            [True, False, False],
        ],
    }
    assert block.nodes.tolist() == nodes.tolist() and block.times.tolist() == times.tolist()
    assert block.dt.dtype == torch.get_default_dtype()
    assert block.dt.tolist() == [
        [2, 3, 4],
        [1, 1, 3],
        [2, 2, 0],
        [0, 0, 0],
        [0, 0, 0],
        [1, 0, 0],
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_recent_two_layers_hand_built(device):
    sampler = TemporalSampler(hand_tcsr(device), [2, 2], strategy="recent")
    b1, b2 = sampler.sample(
        torch.tensor([0, 1], device=device), torch.tensor([5, 1], device=device)
    )
    assert tensors(b1) == {
        "nbr": [[1, 2], [0, 0]],
        "eid": [[3, 1], [0, 0]],
        "ts": [[3, 2], [0, 0]],
        "mask": [[True, True], [False, False]],
    }
    # Layer-2 roots are layer 1's slots: (1, 3), (2, 2) and two padded roots.
    assert b2.nodes.tolist() == [1, 2, 0, 0] and b2.times.tolist() == [3, 2, 0, 0]
    assert tensors(b2) == {
        "nbr": [[2, 0], [0, 0], [0, 0], [0, 0]],
        "eid": [[2, 0], [0, 0], [0, 0], [0, 0]],
        "ts": [[2, 1], [0, 0], [0, 0], [0, 0]],
        "mask": [[True, True], [False, False], [False, False], [False, False]],
    }


@pytest.mark.parametrize("device", DEVICES)
def test_padded_roots_are_masked_even_with_earlier_events(device):
    # Negative float times: a padded layer-1 slot becomes root (node 0, time 0.0), and
    # node 0 does have an event before 0.0, so only the propagated mask hides it.
    g = TCSR.from_events(
        torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([-2.0, -1.0]), 3, device
    )
    sampler = TemporalSampler(g, [1, 1])
    b1, b2 = sampler.sample(
        torch.tensor([2, 1], device=device), torch.tensor([-1.0, 0.5], device=device)
    )
    assert tensors(b1) == {"nbr": [[0], [2]], "eid": [[0], [1]], "ts": [[0.0], [-1.0]],
                           "mask": [[False], [True]]}  # fmt: skip
    assert b1.dt.dtype == torch.float64 and b1.dt.tolist() == [[0.0], [1.5]]
    assert b2.nodes.tolist() == [0, 2]
    assert b2.mask.tolist() == [[False], [False]]

    (b,) = TemporalSampler(g, [2]).sample(
        torch.tensor([1, 1], device=device),
        torch.tensor([9.0, 9.0], device=device),
        root_mask=torch.tensor([False, True], device=device),
    )
    assert b.mask.tolist() == [[False, False], [True, True]]
    assert b.nbr.tolist() == [[0, 0], [2, 0]]


def test_float_times_against_int_index_keep_strict_order():
    sampler = TemporalSampler(hand_tcsr("cpu"), [4])
    (a,) = sampler.sample(torch.tensor([0, 0, 0]), torch.tensor([2.5, 3.0, 3.01]))
    (b,) = sampler.sample(torch.tensor([0, 0, 0]), torch.tensor([3, 3, 4]))
    assert tensors(a) == tensors(b)
    assert a.times.dtype == torch.int64


def test_empty_graph_and_empty_batch():
    empty = TCSR.from_events(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0), 3)
    assert empty.indptr.tolist() == [0, 0, 0, 0] and empty.ts.dtype == torch.float64
    for strategy in ("recent", "uniform"):
        b1, b2 = TemporalSampler(empty, [2, 3], strategy).sample(
            torch.tensor([0, 2]), torch.tensor([1.0, 5.0])
        )
        assert not b1.mask.any() and b2.mask.shape == (4, 3) and not b2.mask.any()
        (b,) = TemporalSampler(hand_tcsr("cpu"), [2], strategy).sample(
            torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        )
        assert b.nbr.shape == (0, 2)


# --- recent: oracle on random graphs --------------------------------------------------


@st.composite
def random_graphs(draw):
    """Small graphs with many ties in time, self-loops and isolated nodes."""
    n = draw(st.integers(1, 6))
    e = draw(st.integers(0, 24))
    ids = st.lists(st.integers(0, n - 1), min_size=e, max_size=e)
    src, dst = draw(ids), draw(ids)
    t = draw(st.lists(st.integers(-2, 5), min_size=e, max_size=e))
    if draw(st.booleans()):
        t = [x / 2 for x in t]
    r = draw(st.integers(0, 8))
    nodes = draw(st.lists(st.integers(0, n - 1), min_size=r, max_size=r))
    times = draw(st.lists(st.integers(-3, 7), min_size=r, max_size=r))
    if isinstance(t[0] if t else 0, float):
        times = [x / 2 for x in times]
    fanouts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    return n, src, dst, t, nodes, times, fanouts


def sample_and_oracle(device, graph):
    n, src, dst, t, nodes, times, fanouts = graph
    t_arr = np.array(t, dtype=np.float64 if t and isinstance(t[0], float) else np.int64)
    g = TCSR.from_events(np.array(src, np.int64), np.array(dst, np.int64), t_arr, n, device)
    blocks = TemporalSampler(g, fanouts, "recent").sample(
        torch.tensor(nodes, dtype=torch.int64, device=device),
        torch.tensor(times, dtype=g.ts.dtype, device=device),
    )
    valid = [True] * len(nodes)
    for block, k in zip(blocks, fanouts):
        expected = oracle_recent(src, dst, t, nodes, times, valid, k)
        assert tensors(block) == expected
        nodes = [x for row in expected["nbr"] for x in row]
        times = [x for row in expected["ts"] for x in row]
        valid = [x for row in expected["mask"] for x in row]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(graph=random_graphs())
def test_recent_matches_oracle(device, graph):
    sample_and_oracle(device, graph)


@pytest.mark.parametrize("seed", [0, 1])
def test_recent_matches_oracle_larger(seed):
    rng = np.random.default_rng(seed)
    n, e = 40, 400
    src = rng.integers(0, n, e).tolist()
    dst = rng.integers(0, n - 5, e).tolist()  # the last 5 nodes only ever appear as src
    t = rng.integers(0, 60, e).tolist()
    nodes = rng.integers(0, n, 50).tolist()
    times = rng.integers(0, 70, 50).tolist()
    sample_and_oracle("cpu", (n, src, dst, t, nodes, times, [7, 3]))


# --- uniform ----------------------------------------------------------------------------


def check_uniform_valid(src, dst, t, block: NeighborBlock, valid: list[bool]):
    """Every sampled slot is a candidate of its root; rows are all-or-nothing."""
    nodes, times = block.nodes.tolist(), block.times.tolist()
    got = tensors(block)
    for r, (v, time) in enumerate(zip(nodes, times)):
        cands = set(oracle_candidates(src, dst, t, v, time)) if valid[r] else set()
        mask = got["mask"][r]
        assert all(mask) if cands else not any(mask)
        for ts, eid, nbr, m in zip(got["ts"][r], got["eid"][r], got["nbr"][r], mask):
            if m:
                assert (ts, eid, nbr) in cands
            else:
                assert (ts, eid, nbr) == (0, 0, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_samples_valid_candidates(device):
    rng = np.random.default_rng(3)
    n, e = 12, 120
    src, dst = rng.integers(0, n, e).tolist(), rng.integers(0, n, e).tolist()
    t = rng.integers(0, 20, e).tolist()
    g = TCSR.from_events(np.array(src), np.array(dst), np.array(t), n, device)
    gen = torch.Generator(device=device).manual_seed(0)
    nodes = torch.arange(n, device=device).repeat(3)
    times = torch.tensor(rng.integers(0, 22, 3 * n), device=device)
    b1, b2 = TemporalSampler(g, [5, 3], "uniform").sample(nodes, times, gen)
    check_uniform_valid(src, dst, t, b1, [True] * len(nodes))
    check_uniform_valid(src, dst, t, b2, b1.mask.flatten().tolist())
    assert b1.mask.any() and not b1.mask.all()  # the test covers both kinds of row


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_is_deterministic_for_a_seeded_generator(device):
    sampler = TemporalSampler(hand_tcsr(device), [4, 2], "uniform")
    nodes = torch.tensor([0, 2, 1, 0], device=device)
    times = torch.tensor([6, 5, 9, 4], device=device)

    def run(seed: int) -> list[dict]:
        gen = torch.Generator(device=device).manual_seed(seed)
        return [tensors(b) for b in sampler.sample(nodes, times, gen)]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("device", DEVICES)
def test_keyed_uniform_depends_on_the_key_alone(device):
    rng = np.random.default_rng(4)
    n, e = 12, 120
    src, dst = rng.integers(0, n, e).tolist(), rng.integers(0, n, e).tolist()
    t = rng.integers(0, 20, e).tolist()
    g = TCSR.from_events(np.array(src), np.array(dst), np.array(t), n, device)
    sampler = TemporalSampler(g, [5, 3], "uniform")
    nodes = torch.arange(n, device=device).repeat(3)
    times = torch.tensor(rng.integers(0, 22, 3 * n), device=device)
    keys = hash_counter(9, 0, torch.arange(3 * n, device=device))
    b1, b2 = sampler.sample(nodes, times, keys=keys)
    check_uniform_valid(src, dst, t, b1, [True] * len(nodes))
    check_uniform_valid(src, dst, t, b2, b1.mask.flatten().tolist())
    # The same roots in another order, among other roots, on another "rank": each
    # keyed root draws the same neighbours in both layers, whatever the generator.
    perm = torch.randperm(3 * n, generator=torch.Generator().manual_seed(0)).to(device)
    gen = torch.Generator(device=device).manual_seed(123)
    c1, c2 = sampler.sample(nodes[perm], times[perm], gen, keys=keys[perm])
    assert torch.equal(c1.eid, b1.eid[perm]) and torch.equal(c1.mask, b1.mask[perm])
    assert torch.equal(c2.eid.view(3 * n, 5, 3), b2.eid.view(3 * n, 5, 3)[perm])
    # Another key draws otherwise.
    d1, _ = sampler.sample(nodes, times, keys=keys + 1)
    assert not torch.equal(d1.eid, b1.eid)


@pytest.mark.parametrize("keyed", [False, True], ids=["generator", "keys"])
@pytest.mark.parametrize("device", DEVICES)
def test_uniform_is_roughly_uniform(device, keyed):
    # Node 0: events to 1..6 at times 0..5 plus a self-loop (eid 6) at time 2, listed
    # twice, so it is drawn twice as often. A root at time 10 sees all 8 entries.
    src = torch.tensor([0, 0, 0, 0, 0, 0, 0])
    dst = torch.tensor([1, 2, 3, 4, 5, 6, 0])
    t = torch.tensor([0, 1, 2, 3, 4, 5, 2])
    g = TCSR.from_events(src, dst, t, 7, device)
    gen = torch.Generator(device=device).manual_seed(1)

    def keys(r: int) -> torch.Tensor | None:
        return hash_counter(1, r, torch.arange(r, device=device)) if keyed else None

    roots = 2000
    (b,) = TemporalSampler(g, [10], "uniform").sample(
        torch.zeros(roots, dtype=torch.int64, device=device),
        torch.full((roots,), 10, device=device),
        gen,
        keys=keys(roots),
    )
    counts = torch.bincount(b.eid.flatten().cpu(), minlength=7).tolist()
    expected = [2500] * 6 + [5000]  # 20000 draws over 8 entries
    # Binomial std is about 47 (69 for the self-loop); 10% is over 3.5 std.
    for got, want in zip(counts, expected):
        assert abs(got - want) < 0.1 * want, (counts, expected)

    # Only the entries strictly before the root's time are drawn: times 0, 1 here.
    (b,) = TemporalSampler(g, [10], "uniform").sample(
        torch.zeros(200, dtype=torch.int64, device=device),
        torch.full((200,), 2, device=device),
        gen,
        keys=keys(200),
    )
    drawn = torch.bincount(b.eid.flatten().cpu(), minlength=7)
    assert drawn[2:].sum() == 0 and drawn[0] > 800 and drawn[1] > 800


# --- device: host-sync free and capturable ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["recent", "uniform"])
def test_sample_has_no_host_sync_and_captures(strategy):
    rng = np.random.default_rng(0)
    n, e, r = 100, 5000, 256
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    t = np.sort(rng.integers(0, 1000, e))
    g = TCSR.from_events(src, dst, t, n, "cuda")
    sampler = TemporalSampler(g, [10, 5], strategy)
    nodes = torch.tensor(rng.integers(0, n, r), device="cuda")
    times = torch.tensor(rng.integers(0, 1100, r), device="cuda")
    sampler.sample(nodes, times)  # warm-up outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler.sample(nodes, times)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if strategy != "recent":
        return
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        blocks = sampler.sample(nodes, times)
    new_nodes = torch.tensor(rng.integers(0, n, r), device="cuda")
    new_times = torch.tensor(rng.integers(0, 1100, r), device="cuda")
    nodes.copy_(new_nodes)
    times.copy_(new_times)
    graph.replay()
    for got, want in zip(blocks, sampler.sample(new_nodes, new_times)):
        assert tensors(got) == tensors(want)
