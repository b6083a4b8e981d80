"""Nothing lost, round 3: every path Sven is given means what the user meant, every
input is checked before work (issue 39).

One test per defect found by trying main as a new user would: 1. ``state.path`` of the
wrong kind; 2. ``state.path`` naming a folder of the user's; 3. two runs on one
``state.path`` at once; 4. ``sven eval`` writing disk-tier scratch; 5. a run's relative
``data.path`` resolved against the folder a later command runs in; 6. model settings
overridden at evaluation; 7. ``dist.partition`` ignored in one process; 8. a partition
refusal said by every rank; 9. ``--dry-run`` writing the default dataset; 10. a
checkpoint's node-state file of another dtype or shape; 11. unclear messages (YAML, a
misshapen section, a whitespace header); 12. an output written into a run's ``best/``;
13. the two-rank example failing without matplotlib. And the one seen besides: ``sven
eval`` on a run whose ``best/`` is empty. Every store here is the test's own (400
events on 30 nodes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from sven.cli import main
from tests.integration.test_nothing_lost import _launch, _write
from tests.integration.test_safety import _one_line, _train

REPO = Path(__file__).resolve().parents[2]


def _tree(*roots: Path) -> dict[str, int]:
    """Every path under ``roots`` with its size (folders -1): what a command wrote."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            out[str(p)] = -1 if p.is_dir() else p.stat().st_size
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(store, a finished run on it); tests that change either copy them first."""
    root = tmp_path_factory.mktemp("lost3")
    store, run = _write(root / "store", 0), root / "run"
    assert main(_train(store, run)) == 0
    return store, run


def _copy_run(trained: tuple[Path, Path], to: Path) -> Path:
    run = to / "run"
    shutil.copytree(trained[1], run)
    return run


# ------------------------------------------------ 1-3. the disk tier's folder


def test_1_state_path_of_the_wrong_kind_is_one_line(trained, tmp_path, capsys) -> None:
    store, _ = trained
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for path, says in (
        (afile, "is a file, not a folder"),
        (afile / "sub", "lies under"),
    ):
        out = tmp_path / f"out-{path.name}"
        argv = _train(store, out, "state.device=disk", f"state.path={path}")
        assert main(argv) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith("sven: error: state.path:") and says in line, line
        assert not out.exists()
    assert afile.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_1_state_path_under_a_folder_that_cannot_be_written_is_one_line(
    trained, tmp_path, capsys
) -> None:
    store, _ = trained
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        argv = _train(store, tmp_path / "out", "state.device=disk", f"state.path={locked / 's'}")
        assert main(argv) == 2
        assert "permission denied" in _one_line(capsys.readouterr().err)
    finally:
        locked.chmod(0o700)


def test_2_state_path_of_a_users_folder_is_refused_and_left_alone(
    trained, tmp_path, capsys
) -> None:
    store, _ = trained
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("years of work")
    before = _tree(mine)
    out = tmp_path / "out"
    assert main(_train(store, out, "state.device=disk", f"state.path={mine}")) == 2
    line = _one_line(capsys.readouterr().err)
    assert "state.path" in line and "notes.txt" in line and "Sven did not write" in line
    assert _tree(mine) == before and not out.exists()
    # Sven's own folder of an earlier run is Sven's to take again.
    own = tmp_path / "own"
    assert main(_train(store, tmp_path / "a", "state.device=disk", f"state.path={own}")) == 0
    assert main(_train(store, tmp_path / "b", "state.device=disk", f"state.path={own}")) == 0
    assert sorted(p.name for p in own.iterdir()) == [".sven-state", "rank0"]


def test_3_two_runs_on_one_state_path_at_once_are_refused(trained, tmp_path, capsys) -> None:
    store, _ = trained
    shared = tmp_path / "shared"
    # Another process holds rank 0's part of the folder, as a run mapping its files does.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from sven.ownership import lock_folder\n"
            f"lock = lock_folder({str(shared / 'rank0')!r}, 'sven train')\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        argv = _train(store, tmp_path / "out", "state.device=disk", f"state.path={shared}")
        assert main(argv) == 1
        line = _one_line(capsys.readouterr().err)
        assert f"pid {holder.pid}" in line and "in use" in line and "rank0" in line
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "out" / "summary.json").exists()


def test_4_eval_with_disk_state_writes_nothing(trained, tmp_path, monkeypatch, capsys) -> None:
    store, run = trained
    here = tmp_path / "here"
    here.mkdir()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    before = _tree(run, store, here, scratch)
    assert main(["eval", "--checkpoint", str(run), "state.device=disk", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert 0.0 <= res["test_ap"] <= 1.0
    # Not in the run, not in the current folder; its scratch went with it.
    assert _tree(run, store, here, scratch) == before


# ------------------------------------------------------- 5. recorded paths


def test_5_a_run_reused_from_another_folder_finds_its_store(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "cm", 0)
    assert main(_train(Path("cm"), Path("run"))) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["path"] == str(tmp_path / "cm")
    assert config["out"] == str(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    argv = ["predict", "--checkpoint", "../run", "--out", "top.csv"]
    assert main([*argv, "--topk", "2", "--src", "1", "--time", "5000"]) == 0
    assert (elsewhere / "top.csv").is_file()
    assert main(["eval", "--checkpoint", "../run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset"] == "cm"


def test_5_a_relative_path_recorded_by_an_older_run_is_its_runs(tmp_path, monkeypatch) -> None:
    from sven.config.paths import recorded_config

    store = _write(tmp_path / "stores" / "cm", 0)
    step = tmp_path / "runs" / "x" / "best" / "step-000000003"
    old = {"data": {"path": "stores/cm"}, "out": "runs/x", "dist": {"partition": "part"}}
    state = {"config": old, "data": {"store": {"path": str(store)}}}
    step.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "runs")  # where "stores/cm" is not
    cfg = recorded_config(state, step, world_size=2)
    # The store the checkpoint recorded; the rest relative to the run folder.
    assert cfg.data.path == str(store)
    assert cfg.dist.partition == str(tmp_path / "runs" / "x" / "part")
    assert cfg.out == str(tmp_path / "runs" / "x" / "runs" / "x")
    # One process needs no partition (a checkpoint of P ranks is read on any number).
    assert recorded_config(state, step, world_size=1).dist.partition == ""


# --------------------------------------------- 6. settings a checkpoint fixes


@pytest.mark.parametrize(
    ("override", "key"),
    [("model.memory_dim=64", "model.memory_dim"), ("model.name=jodie", "model.name")],
)
def test_6_eval_refuses_a_setting_the_checkpoint_fixes(trained, override, key, capsys) -> None:
    _, run = trained
    assert main(["eval", "--checkpoint", str(run), override]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"sven: error: {key}") and "cannot change" in line, line


# ------------------------------------------------------------ 7-8. partitions


def _partition(store: Path, out: Path) -> list[str]:
    return [
        "partition",
        str(store),
        "--parts",
        "2",
        "--strategy",
        "hash",
        "--out",
        str(out),
        "--quiet",
    ]


def test_7_dist_partition_is_checked_in_one_process(trained, tmp_path, capsys) -> None:
    store, _ = trained
    other = _write(tmp_path / "other", 5, n=300)
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    assert main(_partition(other, theirs)) == 0
    assert main(_partition(store, ours)) == 0
    capsys.readouterr()
    cases = (
        (tmp_path / "none", "is not a partition folder"),
        (theirs, "dist.partition"),
        (ours, "has 2 parts but one process runs"),
    )
    for part, says in cases:
        out = tmp_path / f"run-{part.name}"
        assert main(_train(store, out, f"dist.partition={part}")) == 2
        line = _one_line(capsys.readouterr().err)
        assert "dist.partition" in line and says in line, line
        assert not (out / "summary.json").exists()


@pytest.mark.dist
def test_8_a_partition_refusal_under_torchrun_is_said_once(trained, tmp_path) -> None:
    from tests.integration.slurm_cluster import torchrun_cmd

    store, _ = trained
    other = _write(tmp_path / "other", 5, n=300)
    part = tmp_path / "theirs"
    assert main(_partition(other, part)) == 0
    cmd = [*torchrun_cmd(), *_train(store, tmp_path / "run", f"dist.partition={part}")]
    done = _launch([*cmd, "dist.backend=gloo"], tmp_path)
    assert done.stderr.count("sven: error: dist.partition") == 1, done.stderr
    assert done.returncode != 0


# ------------------------------------------------------------ 9. --dry-run


def test_9_dry_run_on_the_default_data_writes_nothing(tmp_path, monkeypatch, capsys) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SVEN_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "train.device=cpu"]) in (0, 2)
    assert "state.device=auto chose" in capsys.readouterr().out
    assert not cache.exists() and list(tmp_path.iterdir()) == []


# --------------------------------------------- 10. node-state files checked


def _edit_node_state(step: Path, field: str, arr: np.ndarray) -> Path:
    """Replaces a field's ``.npy`` in a checkpoint and recomputes its digest, as a
    hand-edited or foreign checkpoint would have it."""
    from sven.engine.checkpoint.format import file_digest

    rel = f"nodes/rank0/{field}.npy"
    np.save(step / rel, arr, allow_pickle=True)
    meta = json.loads((step / "meta.json").read_text())
    meta["files"][rel] = file_digest(step / rel)
    (step / "meta.json").write_text(json.dumps(meta))
    return step / rel


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (np.array([{"x": 1}] * 30, dtype=object), "not a node-state array"),
        (np.zeros((10, 8), dtype=np.float32), "shape (10, 8)"),
        (np.zeros((30, 5), dtype=np.float32), "shape (30, 5)"),
        (np.zeros((30, 8), dtype=np.int8), "dtype int8"),
    ],
    ids=["objects", "rows", "width", "dtype"],
)
def test_10_a_node_state_file_of_another_dtype_or_shape_is_one_line(
    trained, tmp_path, bad, says, capsys
) -> None:
    store, _ = trained
    run = _copy_run(trained, tmp_path)
    best = next((run / "best").iterdir())
    path = _edit_node_state(best, "memory", bad)
    assert main(["eval", "--checkpoint", str(run)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert str(path) in line and says in line, line
    # Resume reads the latest checkpoint the same way.
    latest = sorted((run / "checkpoints").iterdir())[-1]
    path = _edit_node_state(latest, "memory", bad)
    assert main(_train(store, run, "train.resume=true", "train.epochs=2")) == 1
    line = _one_line(capsys.readouterr().err)
    assert str(path) in line and says in line, line


# --------------------------------------------------------- 11. clear messages


def test_11_invalid_yaml_names_the_file_and_line(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 3\n  lr: [1, 2\nmodel: {}\n")
    assert main(["config", "--config", str(bad)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"sven: error: {bad}, line 4, column 6: invalid YAML")
    assert "unicode string" not in line


def test_11_a_misshapen_section_blames_the_file_not_the_override(tmp_path, capsys) -> None:
    preset = tmp_path / "list.yaml"
    preset.write_text("train:\n  - 1\n  - 2\n")
    for extra in ([], ["train.epochs=2"], ["model.memory_dim=8"]):
        assert main(["config", "--config", str(preset), *extra]) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"sven: error: {preset}: section train") and "a list" in line
        assert "override" not in line


def test_11_format_auto_reads_a_whitespace_header(tmp_path, capsys) -> None:
    raw = tmp_path / "events.txt"
    raw.write_text("src dst t\n1 2 10\n2 3 11\n3 1 12\n1 3 13\n2 1 14\n3 2 15\n1 2 16\n")
    assert main(["data", "convert", str(raw), "--out", str(tmp_path / "s")]) == 0
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["num_events"] == 7 and meta["num_nodes"] == 3


# ------------------------------------------------- 12. outputs in Sven's folders


def test_12_an_output_inside_a_runs_best_is_refused(trained, tmp_path, capsys) -> None:
    store, _ = trained
    run = _copy_run(trained, tmp_path)
    step = sorted((run / "checkpoints").iterdir())[-1]
    before = _tree(run)
    for out in (run / "best" / "x.csv", next((run / "best").iterdir()) / "x.csv"):
        argv = ["predict", "--checkpoint", str(step), "--out", str(out), "--topk", "2"]
        assert main([*argv, "--src", "1", "--time", "5000"]) == 1
        line = _one_line(capsys.readouterr().err)
        assert "lies inside" in line and "holds only Sven's files" in line, line
    assert _tree(run) == before
    # So the run stays Sven's alone: an overwrite replaces it.
    assert main(_train(store, run, "train.overwrite=true")) == 0


def test_12_an_output_inside_a_store_or_a_partition_is_refused(trained, tmp_path, capsys):
    store, run = trained
    part = tmp_path / "part"
    assert main(_partition(store, part)) == 0
    for out in (store / "x.csv", part / "x.csv"):
        argv = ["predict", "--checkpoint", str(run), "--out", str(out), "--topk", "2"]
        assert main([*argv, "--src", "1", "--time", "5000"]) == 1
        assert "lies inside" in _one_line(capsys.readouterr().err)
        assert not out.exists()


# ------------------------------------------------------------- 13. examples


def test_13_two_ranks_example_without_matplotlib_says_so_first(tmp_path) -> None:
    """The quick start's environment has no matplotlib: the example says so before its
    first step and ends well. ``sven`` and ``python`` are stand-ins that log their calls
    (a stand-in ``python`` without matplotlib), so no training runs here."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls.log"
    (bin_ / "sven").write_text(
        f'#!/usr/bin/env bash\necho "sven $*" >> {log}\n'
        '[ "$1" = plot ] && { echo "sven: error: sven plot needs matplotlib" >&2; exit 1; }\n'
        "exit 0\n"
    )
    (bin_ / "python").write_text(
        f'#!/usr/bin/env bash\n[ "$1" = -c ] && exit 1\necho "python $*" >> {log}\nexit 0\n'
    )
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "SVEN": str(bin_ / "sven"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", str(REPO / "docs" / "examples" / "two_ranks.sh")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith("note: no matplotlib"), done.stdout
    calls = log.read_text().splitlines()
    assert [c.split()[1] for c in calls] == ["data", "partition", "-m"]


# ------------------------------------------------------------- also seen


def test_also_eval_of_a_run_with_an_empty_best_says_which_model_it_scores(
    trained, tmp_path, capsys
) -> None:
    run = _copy_run(trained, tmp_path)
    shutil.rmtree(run / "best")
    (run / "best").mkdir()
    latest = sorted((run / "checkpoints").iterdir())[-1]
    assert main(["eval", "--checkpoint", str(run), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["checkpoint"] == str(latest)
    note = next(x for x in err.splitlines() if x.startswith("sven: note:"))
    assert "holds no model" in note and str(latest) in note


def test_12_the_folders_sven_owns_are_named(trained, tmp_path) -> None:
    from sven.ownership import sven_folder

    store, run = trained
    best = next((run / "best").iterdir())
    (tmp_path / "state" / "rank0").mkdir(parents=True)
    (tmp_path / "state" / ".sven-state").touch()
    assert sven_folder(store / "sub" / "x.csv") == f"the event store {store}"
    assert sven_folder(best / "nodes") == f"the checkpoint {best}"
    assert sven_folder(run / "checkpoints") == f"checkpoints/ of the run {run}"
    assert (
        sven_folder(tmp_path / "state" / "rank0") == f"the node-state folder {tmp_path / 'state'}"
    )
    # A run's own top, its plots (a manifest of their own) and a folder of the user's.
    for free in (run, run / "plots", run / "preds", tmp_path / "mine"):
        assert sven_folder(free) is None, free
