"""``sven data convert`` / ``sven data info`` end to end, and the installed package layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sven.cli import main
from sven.datasets.identity import fingerprint
from sven.datasets.store import TemporalEvents

REPO = Path(__file__).resolve().parents[2]

# 10 events at t = 0..9; train t <= 6.3 (7 events), val t = 7, test t = 8, 9.
TINY = [(0, 1), (1, 0), (0, 1), (1, 2), (0, 1), (2, 0), (0, 1), (3, 0), (0, 1), (4, 1)]


def write_tiny(path: Path) -> Path:
    path.write_text("".join(f"{s} {d} {t}\n" for t, (s, d) in enumerate(TINY)))
    return path


def test_convert_then_info(tmp_path, capsys):
    raw = write_tiny(tmp_path / "tiny.txt")
    assert main(["data", "convert", str(raw), "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 's'}: 10 events, 5 nodes" in out
    assert "(snap)" in out and "splits train 7 / val 1 / test 2" in out
    assert "input was in time order; no reordering" in out

    assert main(["data", "info", str(tmp_path / "s"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["events"], info["nodes"], info["bipartite"]) == (10, 5, False)
    assert (info["t_min"], info["t_max"], info["time_span"]) == (0, 9, 9)
    # Distinct directed pairs: (0,1) (1,0) (1,2) (2,0) (3,0) (4,1).
    assert info["unique_edges"] == 6 and info["repeat_edge_ratio"] == pytest.approx(0.4)
    # Events per node: [8, 8, 2, 1, 1].
    assert info["degree"] == {"mean": 4.0, "p50": 2.0, "p90": 8.0, "p99": 8.0, "max": 8}
    assert {s: v["events"] for s, v in info["splits"].items()} == {"train": 7, "val": 1, "test": 2}
    assert info["splits"]["test"]["t_first"] == 8
    # Train sees nodes 0, 1, 2: the val event (3, 0) and the test event (4, 1) are inductive.
    assert info["inductive"]["val"] == {"events": 1, "share": 1.0, "new_nodes": 1}
    assert info["inductive"]["test"] == {"events": 1, "share": 0.5, "new_nodes": 1}
    # The identity that runs, checkpoints and partitions record of this store.
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert info["fingerprint"] == fingerprint(meta)

    assert main(["data", "info", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert f"fingerprint {fingerprint(meta)})" in text.splitlines()[0]
    assert "events       10  (train 7 / val 1 / test 2)" in text
    assert "repeats      40.0% of events repeat an earlier (src, dst) pair" in text
    assert "inductive    val 100.0% of events (1 new nodes); test 50.0%" in text


def test_convert_reports_reordering(tmp_path, capsys):
    raw = tmp_path / "u.txt"
    raw.write_text("1 2 5\n2 3 3\n3 4 6\n")
    assert main(["data", "convert", str(raw), "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "note: input was not in time order (1 events earlier than the one before them)" in out
    assert "stable-sorted by time" in out
    assert TemporalEvents.load(tmp_path / "s").meta["sorted_on_ingest"] is True


def test_column_map_flags(tmp_path, capsys):
    raw = tmp_path / "x.csv"
    raw.write_text("when,a,b,w,y\n1,7,8,0.5,1\n2,8,7,1.5,0\n")
    args = ["data", "convert", str(raw), "--out", str(tmp_path / "s"), "--format", "csv"]
    args += ["--src", "a", "--dst", "b", "--time", "when", "--feat", "w", "--label", "y"]
    args += ["--name", "xs", "--val-frac", "0.5", "--test-frac", "0"]
    assert main(args) == 0
    ev = TemporalEvents.load(tmp_path / "s")
    assert ev.meta["name"] == "xs" and ev.meta["edge_feat_dim"] == 1 and ev.meta["has_label"]
    np.testing.assert_array_equal(ev.id_map, [7, 8])
    assert ev.meta["split"]["fractions"] == [0.5, 0.5, 0.0]


def test_existing_output_needs_overwrite(tmp_path, capsys):
    raw = write_tiny(tmp_path / "tiny.txt")
    out = str(tmp_path / "s")
    assert main(["data", "convert", str(raw), "--out", out]) == 0
    assert main(["data", "convert", str(raw), "--out", out]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["data", "convert", str(raw), "--out", out, "--overwrite", "--name", "n2"]) == 0
    assert TemporalEvents.load(out).meta["name"] == "n2"


def test_bad_input_exits_non_zero_with_one_line_and_no_traceback(tmp_path):
    raw = tmp_path / "bad.txt"
    raw.write_text("1 2 3\n-3 2 5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "sven", "data", "convert", str(raw), "--out", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 3
    assert proc.stderr == f"sven: error: {raw}, line 2: negative source id -3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]


def test_info_on_a_non_store(tmp_path, capsys):
    assert main(["data", "info", str(tmp_path)]) == 3
    assert (
        capsys.readouterr().err == f"sven: error: {tmp_path}: not an event store (no meta.json)\n"
    )


def test_data_without_action_prints_usage(capsys):
    assert main(["data"]) == 2
    err = capsys.readouterr().err
    assert "convert" in err and "info" in err


def test_top_level_names_are_not_importable_outside_the_repo(tmp_path):
    """``datasets``, ``partition`` and ``pipeline`` install only as ``sven.*``."""
    code = (
        "import importlib, importlib.util, json\n"
        "out = {}\n"
        "for name in ('datasets', 'partition', 'pipeline'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    out[name] = None if spec is None else spec.origin\n"
        "importlib.import_module('sven.datasets.store')\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    origins = json.loads(proc.stdout)
    for name, origin in origins.items():
        # Absent, or someone else's package of that name (e.g. Hugging Face's), never ours.
        assert origin is None or not str(origin).startswith(str(REPO)), (name, origin)
    for name in ("datasets", "partition", "pipeline"):
        if origins[name] is None:
            proc = subprocess.run(
                [sys.executable, "-c", f"import {name}"],
                capture_output=True,
                text=True,
                cwd=tmp_path,
            )
            assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_unwritable_output_is_a_message(tmp_path, capsys):
    raw = write_tiny(tmp_path / "tiny.txt")
    (tmp_path / "file").write_text("")
    assert main(["data", "convert", str(raw), "--out", str(tmp_path / "file" / "s")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"sven: error: cannot create {tmp_path / 'file' / 's'}: ")
    assert err.count("\n") == 1
