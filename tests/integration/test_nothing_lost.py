"""Nothing lost, round 2: every file Sven replaces is its own, every store it reads is the
one it expects (issue 32).

One test (or a few) per defect found by trying the landed main as a new user would:
1. ``sven eval`` on a store other than the model's; 2. resume on a store replaced in
place; 3. overwrites that deleted a user's files below the top of a run or partition;
4. ``predict``/``embed`` replacing an output or their input; 5. ``plot`` replacing a
user's PNG, or a traceback for a file given as its folder; 6. ``--unknown skip`` rows of
top-k; 7. node classification's late label check and the ``config.json`` an early
error left; 8. ``--pairs`` ignored beside ``--topk``; 9. a usage error under a launcher
said once per rank. And two of the stumbles: 11. ``sven eval`` saying "training";
12. a long CPU run saying nothing of its length. Every store here is the test's own (a
few hundred events).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sven.cli import main
from sven.datasets.store import write_events
from tests.integration.test_safety import _one_line, _train

NODES = 30


def _write(path: Path, seed: int, *, n: int = 400, label: bool = False) -> Path:
    """A random stream of ``n`` events on 30 nodes with 2-dim edge features: every
    seed gives files of the same sizes (same counts, dtypes and widths)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, NODES, n)
    dst = (src + rng.integers(1, NODES, n)) % NODES
    t = 25 * np.arange(n)  # distinct times: every seed splits at the same events
    feat = rng.random((n, 2)).astype(np.float32)
    lab = (np.arange(n) % 7 == 0).astype(np.int64) if label else None
    write_events(path, src, dst, t, edge_feat=feat, label=lab, num_nodes=NODES, name=path.name)
    return path


def _fingerprint(store: Path) -> str:
    from sven.datasets.identity import fingerprint

    return fingerprint(json.loads((store / "meta.json").read_text()))


def _replace_in_place(store: Path, seed: int, scratch: Path) -> None:
    """Puts another valid store (same path, same file sizes) where ``store`` is."""
    other = _write(scratch / f"replacement-{seed}", seed)
    for f in store.iterdir():
        assert f.stat().st_size == (other / f.name).stat().st_size or f.name == "meta.json"
    shutil.rmtree(store)
    shutil.copytree(other, store)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(store, a finished run on it); tests that change the store copy both first."""
    root = tmp_path_factory.mktemp("lost2")
    store = _write(root / "store", 0)
    run = root / "run"
    assert main(_train(store, run)) == 0
    return store, run


def _copy_run(trained: tuple[Path, Path], to: Path) -> tuple[Path, Path]:
    """A copy of the store and of the run, the run's config pointing at the copy."""
    store, run = trained
    shutil.copytree(store, to / "store")
    shutil.copytree(run, to / "run")
    return to / "store", to / "run"


# --------------------------------------------------- 1. eval on another store


def test_1_eval_refuses_a_store_replaced_since_training(trained, tmp_path, capsys) -> None:
    store, run = _copy_run(trained, tmp_path)
    before = _fingerprint(store)
    _replace_in_place(store, 1, tmp_path)
    capsys.readouterr()
    # quiet=false: the refusal comes before the trainer would say what it evaluates.
    assert main(["eval", "--checkpoint", str(run), f"data.path={store}", "quiet=false"]) == 1
    line = _one_line(capsys.readouterr().err)
    # Both stores named: the one the model was trained on, and the one given.
    assert "was trained on another dataset" in line
    assert before in line and _fingerprint(store) in line and "--other-store" in line


def test_1_eval_scores_another_store_only_when_asked_and_says_so(trained, tmp_path, capsys):
    store, run = trained
    other = _write(tmp_path / "other", 2)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), f"data.path={other}"]) == 1
    assert "was trained on another dataset" in _one_line(capsys.readouterr().err)
    argv = ["eval", "--checkpoint", str(run), f"data.path={other}", "--other-store", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert res["store_fingerprint"] == _fingerprint(other)
    assert res["trained_on"] == _fingerprint(store) and "applied to another store" in res["note"]
    assert "sven: note:" in err and "--other-store" in err
    assert 0.0 <= res["test_ap"] <= 1.0
    # The model's own store needs no flag, and its result names that store.
    assert main(["eval", "--checkpoint", str(run), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["store_fingerprint"] == _fingerprint(store) and "note" not in res


def test_1_another_store_of_other_feature_widths_is_refused_even_when_asked(
    trained, tmp_path, capsys
) -> None:
    _, run = trained
    rng = np.random.default_rng(3)
    src = rng.integers(0, NODES, 400)
    other = tmp_path / "wide"
    write_events(other, src, (src + 1) % NODES, 25 * np.arange(400),
                 edge_feat=rng.random((400, 5)).astype(np.float32), num_nodes=NODES)  # fmt: skip
    capsys.readouterr()
    argv = ["eval", "--checkpoint", str(run), f"data.path={other}", "--other-store"]
    assert main(argv) == 1
    line = _one_line(capsys.readouterr().err)
    assert "edge features are 5-dimensional where the model takes 2" in line


def test_11_eval_says_it_evaluates(trained, capsys) -> None:
    _, run = trained
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "quiet=false"]) == 0
    err = capsys.readouterr().err
    assert "training" not in err and err.startswith("evaluating a saved tgn on "), err


def test_12_a_long_cpu_run_says_what_to_expect_before_its_first_step(tmp_path, capsys):
    import sven

    store = _write(tmp_path / "store", 0)
    over = [*_train(store, tmp_path / "run", "train.epochs=8000", "quiet=false")[1:]]
    trainer = sven.Trainer(None, over)

    def stop(_: object) -> None:
        raise KeyboardInterrupt

    trainer.add_hook("before_step", stop)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    err = capsys.readouterr().err
    assert "expect a long run: up to 8000 epochs of 280 training events on the CPU" in err


# ---------------------------------------------- 2. resume on a replaced store


def test_2_resume_refuses_a_store_replaced_in_place(tmp_path, capsys) -> None:
    store, run = _write(tmp_path / "store", 0), tmp_path / "run"
    assert main(_train(store, run)) == 0
    before = _fingerprint(store)
    _replace_in_place(store, 1, tmp_path)
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    argv = _train(store, run, "train.resume=true", "train.epochs=2")
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert "was written on another dataset" in line
    assert before in line and _fingerprint(store) in line
    # Nothing of the run changed.
    assert (run / "metrics.jsonl").read_text() == metrics


def test_2_a_refused_resume_leaves_the_runs_config_as_it_was(trained, tmp_path, capsys):
    store, run = _copy_run(trained, tmp_path)
    config = (run / "config.json").read_text()
    capsys.readouterr()
    argv = _train(store, run, "train.resume=true", "model.memory_dim=16")
    assert main(argv) == 2
    assert "model.memory_dim (8 -> 16)" in _one_line(capsys.readouterr().err)
    # config.json still says what the run's checkpoints hold.
    assert (run / "config.json").read_text() == config


def test_2_a_run_records_its_store_in_summary_and_checkpoints(trained) -> None:
    from sven.engine.checkpoint import find_checkpoint, load_file

    store, run = trained
    summary = json.loads((run / "summary.json").read_text())
    assert summary["store_fingerprint"] == _fingerprint(store)
    state = load_file(find_checkpoint(run / "checkpoints") / "state.pt")
    assert state["data"]["store"]["fingerprint"] == _fingerprint(store)
    assert state["data"]["store"]["path"] == str(store.absolute())


# ------------------------------------- 3. overwrite removes only Sven's files


@pytest.mark.parametrize("where", ["best", "checkpoints", "plots", "checkpoints/step-x"])
def test_3_train_overwrite_keeps_a_users_file_at_any_depth(trained, tmp_path, where, capsys):
    store, run = _copy_run(trained, tmp_path)
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    folder = {"checkpoints/step-x": step}.get(where, run / where)
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    capsys.readouterr()
    assert main(_train(store, run, "train.overwrite=true")) == 2
    line = _one_line(capsys.readouterr().err)
    rel = (folder / "notes.txt").relative_to(run).as_posix()
    assert f"holds {rel}, not written by Sven" in line
    # Refused before deleting anything.
    assert (folder / "notes.txt").read_text() == "my notes"
    assert (run / "summary.json").is_file() and (step / "state.pt").is_file()


def test_3_train_overwrite_still_replaces_a_run_with_its_own_plots(trained, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    store, run = _copy_run(trained, tmp_path)
    assert main(["plot", str(run)]) == 0
    assert main(_train(store, run, "train.overwrite=true")) == 0
    assert not (run / "plots").exists() and (run / "summary.json").is_file()


def test_3_a_runs_plots_of_an_older_sven_are_its_own(trained, tmp_path) -> None:
    # Figures plotted before the plots folder had a manifest: known by name.
    store, run = _copy_run(trained, tmp_path)
    (run / "plots").mkdir()
    (run / "plots" / "training.png").write_bytes(b"an older sven's figure")
    assert main(_train(store, run, "train.overwrite=true")) == 0
    assert not (run / "plots").exists()


def test_3_partition_overwrite_keeps_a_users_file_in_its_plots(trained, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    store, _ = trained
    part = tmp_path / "part"
    base = ["partition", str(store), "--strategy", "hash", "--parts", "2", "--quiet"]
    assert main([*base, "--out", str(part)]) == 0
    assert main(["plot", str(part)]) == 0
    (part / "plots" / "for-the-paper.png").write_bytes(b"mine")
    capsys.readouterr()
    assert main([*base, "--out", str(part), "--overwrite"]) == 3
    line = _one_line(capsys.readouterr().err)
    assert "plots/for-the-paper.png, not written by Sven" in line
    assert (part / "plots" / "for-the-paper.png").read_bytes() == b"mine"
    # Sven's own figure is no obstacle: without the user's file the overwrite goes on.
    (part / "plots" / "for-the-paper.png").unlink()
    assert main([*base, "--out", str(part), "--overwrite"]) == 0


# ------------------------------------------------- 4. predict and embed outputs


def _pairs(path: Path) -> Path:
    pd.DataFrame({"src": [0, 1, 2], "dst": [3, 4, 5], "t": [5000] * 3}).to_csv(path, index=False)
    return path


def test_4_predict_refuses_an_existing_output_and_never_writes_over_its_input(
    trained, tmp_path, capsys
) -> None:
    _, run = trained
    pairs = _pairs(tmp_path / "pairs.csv")
    kept = pairs.read_text()
    base = ["predict", "--checkpoint", str(run), "--pairs", str(pairs), "--device", "cpu"]
    # --out is the input: refused, --overwrite or not, before any work.
    for extra in ([], ["--overwrite"]):
        capsys.readouterr()
        assert main([*base, "--out", str(pairs), *extra]) == 1
        assert "which this command reads" in _one_line(capsys.readouterr().err)
        assert pairs.read_text() == kept
    # An existing file of the user's: refused without --overwrite.
    out = tmp_path / "scores.csv"
    out.write_text("my scores\n")
    assert main([*base, "--out", str(out)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "already exists; pass --overwrite" in line and out.read_text() == "my scores\n"
    assert main([*base, "--out", str(out), "--overwrite"]) == 0
    assert len(pd.read_csv(out)) == 3
    # No temporary file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.csv", "scores.csv"]


def test_4_embed_refuses_an_existing_output_and_its_id_file(trained, tmp_path, capsys) -> None:
    store, run = trained
    ids = tmp_path / "ids.npy"
    ids.write_text("0\n1\n")
    base = ["embed", "--checkpoint", str(run), "--time", "5000", "--device", "cpu"]
    capsys.readouterr()
    assert main([*base, "--nodes", f"@{ids}", "--out", str(ids), "--overwrite"]) == 1
    assert "which this command reads" in _one_line(capsys.readouterr().err)
    assert ids.read_text() == "0\n1\n"
    # Nor inside the event store (a column there would break it) or the checkpoints.
    for inside in (store / "emb.npy", run / "checkpoints" / "emb.npy"):
        assert main([*base, "--nodes", "0,1", "--out", str(inside)]) == 1
        assert "which this command reads" in _one_line(capsys.readouterr().err)
        assert not inside.exists()
    emb = tmp_path / "emb.npy"
    np.save(emb, np.arange(3))
    assert main([*base, "--nodes", "0,1", "--out", str(emb)]) == 1
    assert "already exists" in _one_line(capsys.readouterr().err)
    assert np.load(emb).tolist() == [0, 1, 2]
    assert main([*base, "--nodes", "0,1", "--out", str(emb), "--overwrite"]) == 0
    assert np.load(emb).shape == (2, 8)


# --------------------------------------------------------------- 5. plot outputs


def test_5_plot_never_replaces_a_users_png_and_a_file_as_out_is_one_line(
    trained, tmp_path, capsys
) -> None:
    pytest.importorskip("matplotlib")
    _, run = trained
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "training.png").write_bytes(b"my figure")
    capsys.readouterr()
    assert main(["plot", str(run), "--out", str(figs)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "training.png, not written by Sven" in line and "--overwrite" in line
    assert (figs / "training.png").read_bytes() == b"my figure"
    # A file where the folder goes: one line, nothing written.
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert main(["plot", str(run), "--out", str(notes)]) == 1
    assert "is a file, not a folder" in _one_line(capsys.readouterr().err)
    assert notes.read_text() == "mine"
    # Sven's own figures are replaced by a new plot; the user's with --overwrite.
    own = tmp_path / "own"
    assert main(["plot", str(run), "--out", str(own)]) == 0
    assert main(["plot", str(run), "--out", str(own)]) == 0
    assert main(["plot", str(run), "--out", str(figs), "--overwrite"]) == 0
    assert (figs / "training.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------ 6. and 8. predict's options


@pytest.fixture(scope="module")
def raw_ids_run(tmp_path_factory) -> Path:
    """A run on a store whose raw ids are 100..129, so no raw id is 0."""
    root = tmp_path_factory.mktemp("rawids")
    rng = np.random.default_rng(4)
    src = rng.integers(0, NODES, 400)
    dst = (src + rng.integers(1, NODES, 400)) % NODES
    store = root / "store"
    write_events(store, src + 100, dst + 100, 25 * np.arange(400), name="raw")
    run = root / "run"
    assert main(_train(store, run)) == 0
    return run


def test_6_topk_with_unknown_skip_leaves_out_the_unknown_sources(
    raw_ids_run, tmp_path, capsys
) -> None:
    out = tmp_path / "top.csv"
    argv = ["predict", "--checkpoint", str(raw_ids_run), "--topk", "3", "--src", "100,7,101"]
    assert main([*argv, "--time", "9000", "--unknown", "skip", "--out", str(out)]) == 0
    assert "skipped 1 rows whose source ids" in capsys.readouterr().err
    top = pd.read_csv(out)
    # Three rows per known source; none for the unknown 7, no destination outside the map.
    assert top["src"].tolist() == [100] * 3 + [101] * 3
    assert top["rank"].tolist() == [1, 2, 3] * 2
    assert top["dst"].between(100, 129).all() and top["score"].notna().all()


def test_8_pairs_beside_topk_is_a_usage_error(trained, tmp_path, capsys) -> None:
    _, run = trained
    pairs = _pairs(tmp_path / "pairs.csv")
    out = tmp_path / "o.csv"
    base = ["predict", "--checkpoint", str(run), "--out", str(out)]
    capsys.readouterr()
    argv = [*base, "--pairs", str(pairs), "--topk", "3", "--src", "0", "--time", "9000"]
    assert main(argv) == 2
    assert "--pairs and --topk" in _one_line(capsys.readouterr().err)
    # Top-k's options beside --pairs are no quieter.
    assert main([*base, "--pairs", str(pairs), "--src", "0", "--time", "1"]) == 2
    assert "--src, --time go with --topk" in _one_line(capsys.readouterr().err)
    assert not out.exists()


# ------------------------------------------------------- 7. node classification


def _nc(store: Path, out: Path, *extra: str) -> list[str]:
    return [*_train(store, out, "task=node_classification", "nc.epochs=1"), *extra]


def test_7_labels_are_checked_before_the_encoder_trains_and_nothing_is_left(
    tmp_path, capsys
) -> None:
    bare = _write(tmp_path / "bare", 0)
    out = tmp_path / "nc"
    assert main(_nc(bare, out)) == 3
    line = _one_line(capsys.readouterr().err)
    assert "needs per-event labels" in line
    # No encoder was trained, and nothing blocks the rerun.
    assert not out.exists()
    labelled = _write(tmp_path / "labelled", 0, label=True)
    assert main(_nc(labelled, out)) == 0
    assert json.loads((out / "summary.json").read_text())["task"] == "node_classification"


def test_7_an_encoder_that_is_not_there_leaves_nothing(trained, tmp_path, capsys) -> None:
    labelled = _write(tmp_path / "labelled", 0, label=True)
    out = tmp_path / "nc"
    assert main(_nc(labelled, out, f"nc.encoder={tmp_path / 'missing'}")) == 1
    assert "no checkpoint at" in _one_line(capsys.readouterr().err)
    assert not out.exists()
    # An encoder of another store: refused before anything is written too.
    _, run = trained
    other = _write(tmp_path / "other", 5, label=True)
    assert main(_nc(other, out, f"nc.encoder={run}")) == 1
    assert "was trained on another dataset" in _one_line(capsys.readouterr().err)
    assert not out.exists()
    # The encoder's own events with labels added are its store: labels are no events.
    assert main(_nc(labelled, out, f"nc.encoder={run}")) == 0


# --------------------------------------------------------------- 9. launchers


def _launch(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    from tests.integration.slurm_cluster import sven_env

    return subprocess.run(
        cmd, cwd=cwd, env=sven_env(), capture_output=True, text=True, timeout=240, check=False
    )


@pytest.mark.dist
def test_9_a_config_error_under_torchrun_is_said_once(tmp_path) -> None:
    from tests.integration.slurm_cluster import torchrun_cmd

    cmd = [*torchrun_cmd(), "train", "train.lr=abc", f"out={tmp_path / 'run'}"]
    done = _launch(cmd, tmp_path)
    assert done.stderr.count("sven: error: train.lr: expected a number, got 'abc'") == 1, (
        done.stderr
    )
    assert done.returncode != 0
    assert not (tmp_path / "run").exists()


@pytest.mark.dist
def test_9_a_data_error_under_torchrun_is_said_once_and_leaves_no_folder(tmp_path) -> None:
    from tests.integration.slurm_cluster import torchrun_cmd

    out = tmp_path / "run"
    cmd = [*torchrun_cmd(), "train", f"data.path={tmp_path / 'none'}", f"out={out}"]
    done = _launch([*cmd, "train.device=cpu"], tmp_path)
    assert done.stderr.count("sven: error: data.path: no event store at") == 1, done.stderr
    assert done.returncode != 0
    assert not out.exists()


@pytest.mark.dist
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (OpenMPI) not installed")
def test_9_a_config_error_under_mpirun_is_said_once_with_exit_2(tmp_path) -> None:
    from tests.integration.slurm_cluster import VENV_BIN

    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    cmd += [str(VENV_BIN / "sven"), "train", "train.lr=abc", f"out={tmp_path / 'run'}"]
    done = _launch(cmd, tmp_path)
    assert done.stderr.count("sven: error: train.lr: expected a number, got 'abc'") == 1, (
        done.stderr
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
