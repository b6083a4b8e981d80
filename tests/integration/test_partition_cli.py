"""``sven partition`` and ``sven partition report`` end to end on a small store."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sven.cli import main
from sven.datasets.store import TemporalEvents, write_events
from sven.partition.store import load_partition


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    n, e = 60, 1500
    comm = np.arange(n) % 4
    src = rng.integers(0, n, e)
    inside = (src + 4 * rng.integers(1, 5, e)) % n  # same community (same id mod 4)
    dst = np.where(rng.random(e) < 0.8, inside, rng.integers(0, n, e))
    assert (comm[inside] == comm[src]).all()
    t = np.sort(rng.integers(0, 10**6, e))
    path = tmp_path_factory.mktemp("store") / "s"
    write_events(path, src, dst, t, num_nodes=n, name="tiny")
    return path


def test_partition_writes_dir_and_json_report(store, tmp_path, capsys):
    out = tmp_path / "p"
    argv = ["partition", str(store), "--parts", "3", "--strategy", "minmax", "--batch", "100"]
    assert main([*argv, "--out", str(out), "--k", "4", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    meta, report = doc["partition"], doc["report"]
    assert (meta["strategy"], meta["parts"], meta["batch_size"], meta["k"]) == ("minmax", 3, 100, 4)
    ev = TemporalEvents.load(store)
    assert meta["num_train_events"] == ev.split_range("train")[1]
    assert meta["store"]["checksums"]["src"] == ev.meta["checksums"]["src"]
    summary = report["summary"]
    assert summary["metrics"]["events"]["total"] == meta["num_train_events"]
    assert summary["metrics"]["events"]["imbalance"] <= 1.05 + 1e-9
    assert summary["metrics"]["vertices"]["total"] == 60
    assert len(report["per_rank"]["comm_bytes"]) == 3
    part = load_partition(out, verify=True)
    assert part.owner.shape == (60,) and part.assign.shape == (1500,)
    assert meta["report"] == summary

    # The report command replays the same epoch with the settings stored in meta.json.
    assert main(["partition", "report", str(store), str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)["report"]
    assert again == report


def test_table_output(store, tmp_path, capsys):
    out = tmp_path / "p"
    argv = ["partition", str(store), "--parts", "2", "--strategy", "hash", "--out", str(out)]
    assert main([*argv, "--quiet"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(
        "partition hash into 2 ranks (balance 1.05 per batch, seed 0; cost model of tgn)"
    )
    for word in ("rank", "remote_reads", "comm_bytes", "naive_bytes", "max/mean"):
        assert word in text
    assert "redundancy-free saves" in text
    assert "per-batch max/mean: events " in text and ", bytes sent " in text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["batch_balance"] is True
    assert set(meta["batch_stats"]) == {"batches", "over_cap", "forced", "event_imbalance"}
    # Without per-batch balance only the epoch is capped.
    assert main([*argv, "--quiet", "--overwrite", "--no-batch-balance"]) == 0
    assert "(balance 1.05, seed 0;" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text())["batch_balance"] is False
    # Different cost settings on report override those recorded.
    assert main(["partition", "report", str(store), str(out), "--batch", "50"]) == 0
    assert "of 50, k=10" in capsys.readouterr().out


def test_model_access_is_recorded_and_replayed(store, tmp_path, capsys):
    out = tmp_path / "apan"
    argv = ["partition", str(store), "--parts", "2", "--strategy", "minmax", "--out", str(out)]
    assert main([*argv, "--model", "apan", "--quiet", "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["partition"]["model"] == "apan"
    assert built["report"]["summary"]["access"] == {
        "sample_roots": "positive",
        "read_neighbors": False,
        "deliver_to_neighbors": True,
    }
    # report replays APAN's accesses unless told otherwise.
    assert main(["partition", "report", str(store), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["report"] == built["report"]
    assert main(["partition", "report", str(store), str(out), "--json", "--model", "tgn"]) == 0
    tgn = json.loads(capsys.readouterr().out)["report"]

    # TGN reads the neighbours of every root, so it reads more than APAN (per
    # occurrence: at batch 600 on 60 nodes the roots alone cover every node).
    def naive_reads(rep: dict) -> int:
        return rep["summary"]["metrics"]["naive_reads"]["total"]

    assert naive_reads(tgn) > naive_reads(built["report"])


def test_user_errors_are_one_line(store, tmp_path, capsys):
    assert main(["partition", str(store), "--parts", "2", "--strategy", "hash"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "sven: error: sven partition DATA needs --parts, --strategy and --out"

    assert main(["partition", "report", str(store)]) == 2
    assert "usage: sven partition report DATA PART_DIR" in capsys.readouterr().err

    assert main(["partition", str(tmp_path / "none"), "--parts", "2", "--strategy", "hash",
                 "--out", str(tmp_path / "x")]) == 3  # fmt: skip
    assert "not an event store" in capsys.readouterr().err

    out = tmp_path / "p"
    argv = ["partition", str(store), "--parts", "2", "--strategy", "range", "--out", str(out)]
    assert main([*argv, "--quiet"]) == 0
    capsys.readouterr()
    assert main([*argv, "--quiet"]) == 3
    assert "already exists" in capsys.readouterr().err

    # A partition is never evaluated against other data.
    other = tmp_path / "other"
    write_events(other, np.array([0, 1]), np.array([1, 0]), np.array([0, 1]), name="o")
    assert main(["partition", "report", str(other), str(out)]) == 3
    assert "partition was built for a store with num_events=1500" in capsys.readouterr().err


def test_unknown_strategy_is_rejected_by_the_parser(store, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["partition", str(store), "--parts", "2", "--strategy", "nope", "--out", "x"])
    assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_report_simulate_predicts_from_the_per_batch_bytes(store, tmp_path, capsys):
    from sven.partition.api import evaluate_store
    from sven.partition.report import row_bytes
    from sven.partition.scaling import Link, Machine, simulate

    out = tmp_path / "p"
    argv = ["partition", str(store), "--parts", "2", "--strategy", "hash", "--batch", "100"]
    assert main([*argv, "--out", str(out), "--k", "4", "--quiet"]) == 0
    capsys.readouterr()
    flags = ["--simulate", "--compute-ms", "2", "--compute-us-per-event", "10",
             "--bandwidth-gbs", "0.01", "--latency-us", "50", "--grad-bytes", "1000",
             "--hidden", "0.5", "--json"]  # fmt: skip
    assert main(["partition", "report", str(store), str(out), *flags]) == 0
    sim = json.loads(capsys.readouterr().out)["simulate"]
    ev = TemporalEvents.load(store)
    report = evaluate_store(
        ev, load_partition(out), parts=2, batch_size=100, k=4, widths=row_bytes(), per_batch=True
    )
    machine = Machine(2.0, 10.0, Link(0.01, 50.0), Link(25.0, 10.0), grad_bytes=1000, hidden=0.5)
    assert sim["partition"] == simulate(report.batches, report.widths, machine).summary()
    # One rank at the same global batch: compute only, 2 ms + 10 us per event.
    e, nb = report.events.sum(), report.num_batches
    assert sim["one_rank"]["step_ms"] == pytest.approx(2.0 + 0.01 * e / nb)
    assert sim["one_rank"]["comm_ms"] == 0.0
    assert sim["partition"]["comm_ms"] > 0.0
    assert main([*argv, "--out", str(tmp_path / "q"), "--simulate"]) != 0
    assert "--simulate goes with 'sven partition report" in capsys.readouterr().err
