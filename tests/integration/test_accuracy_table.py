"""benchmarks/accuracy_table.py end to end on a tiny store: train, record, skip, render."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_accuracy_table_trains_records_and_skips(tmp_path: Path) -> None:
    from sven.datasets.synth import generate

    # A store under the dataset's name stands in for the converted public file.
    generate(tmp_path / "data" / "collegemsg", events=2000, nodes=50, seed=0)
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "accuracy_table.py"),
        "--data-root",
        str(tmp_path / "data"),
        "--out",
        str(tmp_path / "acc"),
        "--seeds",
        "0",
        "--models",
        "jodie",
        "--datasets",
        "collegemsg",
        "--max-epochs",
        "1",
        "--threads",
        "1",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    results = json.loads((tmp_path / "acc" / "results.json").read_text())
    run = results["collegemsg-jodie-s0"]
    assert "error" not in run, run
    assert 0.0 <= run["test_ap"] <= 1.0 and run["epochs_run"] == 1
    assert "| collegemsg | jodie | 1 |" in first.stdout
    # A second call finds the run recorded and trains nothing.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "0 runs to do" in again.stdout, again.stdout


def test_schedule_starts_the_largest_dataset_first() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "accuracy_table", REPO / "benchmarks" / "accuracy_table.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    todo = [
        ("collegemsg", "tgn", 0),
        ("collegemsg", "apan", 0),
        ("wikipedia", "tgn", 0),
        ("bitcoin-otc", "tgn", 0),
        ("wikipedia", "apan", 0),
    ]
    events = {"collegemsg": 59_835, "wikipedia": 157_474, "bitcoin-otc": 35_592}
    assert mod.schedule(todo, events) == [
        ("wikipedia", "tgn", 0),
        ("wikipedia", "apan", 0),
        ("collegemsg", "tgn", 0),
        ("collegemsg", "apan", 0),
        ("bitcoin-otc", "tgn", 0),
    ]
