"""benchmarks/bench_factored.py: the factored kernel's cases and byte count at the MRR
batch's shape (the timings themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_factored", ROOT / "benchmarks" / "bench_factored.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_factored"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_each_case_changes_little_from_an_earlier_one() -> None:
    b = _bench()
    all_cases = b.cases(quick=False)
    base = all_cases[0]
    assert (base.roots, base.slots, base.time_dim, base.edge_dim) == (20_600, 10, 100, 172)
    assert len({c.name for c in all_cases}) == len(all_cases)
    # A case is the default or an earlier case with at most two fields changed: a
    # timing's difference then has one or two causes.
    for i, c in enumerate(all_cases[1:], 1):
        fewest = min(
            (
                [
                    f
                    for f in c.__dataclass_fields__
                    if f != "name" and getattr(c, f) != getattr(e, f)
                ]
                for e in all_cases[:i]
            ),
            key=len,
        )
        assert 1 <= len(fewest) <= 2, (c, fewest)


def test_least_bytes_by_hand() -> None:
    # One root, one slot, one head of 2, time 3, edges 4: q, qt, qe read (2 + 3 + 4
    # floats), the slot's index 8 + gap 4 + flag 1 + key and value rows 4 floats + its
    # edge row 4 floats and its index 8, the output and sums written (2 + 3 + 4 floats).
    b = _bench()
    c = b.Case("tiny", roots=1, slots=1, heads=1, head_dim=2, time_dim=3, edge_dim=4)
    assert b.least_bytes(c) == 4 * 9 + (8 + 4 + 1 + 16 + 16 + 8) + 4 * 9
    assert b.least_bytes(b.Case("x", roots=3, slots=1, heads=1, head_dim=2, time_dim=3,
                                edge_dim=0)) == 3 * (4 * 5 + 8 + 4 + 1 + 16 + 4 * 5)  # fmt: skip


def test_inputs_have_the_wrappers_shapes() -> None:
    b = _bench()
    c = b.Case("small", roots=5, slots=3, events=11, nodes=7)
    q, kvn, nbr, dt, mask, tw, tb, wt, table, we, rows, qr = b.inputs(c, torch.device("cpu"))
    assert qr is None
    assert q.shape == (5, 2, 50) and kvn.shape == (7, 200) and nbr.shape == (5, 3)
    assert dt.shape == mask.shape == rows.shape == (5, 3) and mask.dtype == torch.bool
    assert tw.shape == tb.shape == (100,) and wt.shape == (200, 100)
    assert table.shape == (11, 172) and we.shape == (200, 172)
    assert int(nbr.max()) < 7 and int(rows.max()) < 11


def test_per_node_inputs_share_query_rows() -> None:
    b = _bench()
    c = b.Case("small", roots=5, slots=3, events=11, nodes=7, edge_dim=0, per_node=True)
    q, *_, table, we, rows, qr = b.inputs(c, torch.device("cpu"))
    assert q.shape == (7, 2, 50) and qr.shape == (5,) and int(qr.max()) < 7
    assert table is None and we is None and rows is None
