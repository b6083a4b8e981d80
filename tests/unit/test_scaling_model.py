"""The scaling model's arithmetic on hand-built counts, and the benchmark's outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sven.partition.report import BatchCounts, RowBytes
from sven.partition.scaling import Link, Machine, fit_compute, simulate

WIDTHS = RowBytes(read=100, write=50, id=10)
# One batch, two ranks: rank 0 has 3 events, reads 2 remote rows (served by rank 1) and
# writes 1 remote row (to rank 1); rank 1 has 1 event, reads 1 row (served by rank 0).
COUNTS = BatchCounts(
    events=np.array([[3, 1]]),
    remote_reads=np.array([[2, 1]]),
    remote_writes=np.array([[1, 0]]),
    served_reads=np.array([[1, 2]]),
    received_writes=np.array([[0, 1]]),
)
# 10^4 bytes/s (1 byte = 0.1 ms), 1 ms per collective.
SLOW = Link(bandwidth_gbs=1e-5, latency_us=1000.0)


def _machine(**kw) -> Machine:
    args = dict(compute_ms=1.0, compute_us_per_event=20_000.0, intra=SLOW, inter=SLOW,
                ranks_per_node=8, grad_bytes=20, hidden=0.5)  # fmt: skip
    args.update(kw)
    return Machine(**args)


def test_two_ranks_by_hand():
    pred = simulate(COUNTS, WIDTHS, _machine())
    # Compute: rank 0 1 + 3 * 20 = 61 ms, rank 1 1 + 20 = 21 ms.
    # Rank 0's phases, max(sent, received) bytes: ids max(2*10, 1*10) = 20, rows
    # max(1*100, 2*100) = 200, write ids max(10, 0) = 10, write rows max(50, 0) = 50:
    # 280 bytes = 28 ms, plus 4 phases x 2 collectives x 1 ms = 8 ms. Rank 1 mirrors it
    # (20, 200, 10, 50). Ring all-reduce: 2 (P-1) = 2 latencies + 2/2 * 20 bytes = 4 ms.
    comm = 28.0 + 8.0 + 4.0
    np.testing.assert_allclose(pred.step_s, [(61.0 + comm) / 1e3])
    # Pipeline hiding half the communication: 61 + 40 - min(20, 61) = 81 ms.
    np.testing.assert_allclose(pred.step_pipelined_s, [81.0 / 1e3])
    np.testing.assert_allclose(pred.compute_s, [0.061])
    np.testing.assert_allclose(pred.comm_s, [comm / 1e3])
    assert pred.events_per_s == pytest.approx(4 / 0.101)
    assert pred.events_per_s_pipelined == pytest.approx(4 / 0.081)
    # Critical path 3 events against a mean of 2; bytes even.
    assert pred.batch_event_imbalance == pytest.approx(1.5)
    assert pred.batch_comm_imbalance == pytest.approx(1.0)
    # Sent: rank 0 2 ids + 1 served row + 1 write (10 + 50) = 180, rank 1 1 id + 2 rows
    # = 210; received mirrors it (210, 180).
    assert pred.batch_sent_imbalance == pytest.approx(210 / 195)
    assert pred.batch_recv_imbalance == pytest.approx(210 / 195)


def test_pipeline_cannot_hide_more_than_the_compute():
    # Hiding everything: rank 0 max(61, 40) = 61, rank 1 max(21, 40) = 40 -> 61 ms.
    pred = simulate(COUNTS, WIDTHS, _machine(hidden=1.0))
    np.testing.assert_allclose(pred.step_pipelined_s, [0.061])


def test_ranks_on_two_nodes_use_the_inter_node_link():
    fast = Link(bandwidth_gbs=1e3, latency_us=0.0)
    # One rank per node: every byte and every latency goes over the (slow) inter link.
    split = simulate(COUNTS, WIDTHS, _machine(intra=fast, ranks_per_node=1))
    np.testing.assert_allclose(split.comm_s, [0.040])
    # Both on one node: only the fast link, no latency, next to nothing.
    same = simulate(COUNTS, WIDTHS, _machine(inter=SLOW, intra=fast, ranks_per_node=2))
    assert same.comm_s[0] < 1e-6


def test_one_rank_has_no_communication_and_shared_cores_slow_compute():
    events = COUNTS.events.sum(axis=1, keepdims=True)
    one = BatchCounts(events, *(np.zeros_like(events) for _ in range(4)))
    pred = simulate(one, WIDTHS, _machine())
    np.testing.assert_allclose(pred.step_s, [0.081])  # 1 + 4 * 20 ms
    # Two ranks on one core: each computes at half speed.
    shared = simulate(COUNTS, WIDTHS, _machine(concurrent_ranks=1))
    np.testing.assert_allclose(shared.step_s, [(2 * 61.0 + 40.0) / 1e3])


def test_fit_compute_recovers_a_line():
    a, b = fit_compute([150, 300, 600], [10 + 0.15 * 2, 10 + 0.3 * 2, 10 + 0.6 * 2])
    assert a == pytest.approx(10.0)
    assert b == pytest.approx(2.0)  # 2 us per event
    assert fit_compute([600], [12.0]) == (12.0, 0.0)


def test_hidden_out_of_range_is_refused():
    with pytest.raises(ValueError):
        _machine(hidden=1.5)


def test_benchmark_writes_json_markdown_and_png(tmp_path: Path):
    from sven.datasets.synth import generate

    store = tmp_path / "store"
    generate(store, events=3_000, nodes=120, seed=0)
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable, str(root / "benchmarks" / "scaling_model.py"), "--data", str(store),
        "--parts-list", "1,2,4", "--batch-per-rank", "100", "--compute-ms", "2",
        "--compute-us-per-event", "10", "--measured", "1=40000", "hash:2=50000",
        "--out", str(out), "--quiet",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads((out / "scaling.json").read_text())
    rows = {(r["strategy"], r["parts"]): r for r in res["rows"]}
    assert set(rows) == {("-", 1), ("hash", 2), ("minmax", 2), ("hash", 4), ("minmax", 4)}
    assert rows[("hash", 4)]["batch"] == 400
    # P = 1: no communication; a step is 2 ms + 0.01 ms per event.
    e = res["num_train_events"]
    assert rows[("-", 1)]["comm_ms"] == 0.0
    epoch_ms = -(-e // 100) * 2 + 0.01 * e
    assert rows[("-", 1)]["events_per_s"] == pytest.approx(e / (epoch_ms / 1e3))
    assert rows[("hash", 2)]["error"] == pytest.approx(
        rows[("hash", 2)]["events_per_s"] / 50_000 - 1
    )
    assert "| hash | 2 | 200 |" in (out / "scaling.md").read_text()
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
