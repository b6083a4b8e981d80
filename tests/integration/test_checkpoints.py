"""Checkpoints of real runs: written once, in the background, resumed exactly, read back
from format 1, and a write that fails (``ulimit -f``, a full disk) loses nothing.

Each run is a tiny model on a few hundred events (seconds).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import sven
import sven.tasks.link as link_mod
from sven.cli import main
from sven.datasets.store import TemporalEvents
from sven.engine.checkpoint import Checkpointer, load_file, read_meta, read_state
from sven.errors import CheckpointError
from tests.conftest import Interrupted, die_at, write_tiny_store
from tests.unit.test_components import _overrides as _tiny

SVEN = [sys.executable, "-m", "sven"]
METRICS = ("val_ap", "val_auc", "test_ap", "test_auc", "test_ap_inductive", "test_auc_inductive")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    return write_tiny_store(root / "store", events=800, nodes=40, seed=3, t_max=10_000, edge_dim=2)


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory) -> Path:
    """Few events over many vertices: a node state of megabytes beside a tiny model."""
    root = tmp_path_factory.mktemp("wide")
    return write_tiny_store(root / "store", events=600, nodes=20_000, seed=4, t_max=10_000)


def _overrides(store: Path, out: Path, *extra: str) -> list[str]:
    # The unit tests' tiny model, two epochs of 50-event batches.
    return _tiny(str(store), out, "train.epochs=2", "model.dropout=0.0", *extra)


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> dict:
    """An uninterrupted run with a checkpoint every 4 batches."""
    out = tmp_path_factory.mktemp("ref") / "run"
    return sven.Trainer(None, _overrides(store, out, "train.checkpoint_every=4")).fit()


def test_the_commit_runs_beside_training_and_resume_is_exact(store, tmp_path, reference) -> None:
    """The checkpoint at step 4 is held back while two more steps train; released, it
    commits, and a run resumed from it ends where the uninterrupted one did."""
    out = tmp_path / "run"
    over = _overrides(store, out, "train.checkpoint_every=4")
    tr = sven.Trainer(None, over)
    held, go = threading.Event(), threading.Event()
    seen: list[tuple[bool, bool]] = []
    step4 = out / "checkpoints" / "step-000000004"

    def hold(folder: Path) -> None:
        if folder == step4:
            held.set()
            go.wait(timeout=120)

    def beside(t) -> None:
        if held.is_set() and not go.is_set():
            # A training step ran while the commit waits: its folder is still temporary.
            seen.append((step4.exists(), step4.with_name(".tmp-step-000000004").is_dir()))
            if len(seen) == 2:
                go.set()

    tr.checkpoints.latest.before_commit = hold
    tr.add_hook("after_step", beside)
    tr.add_hook("before_step", die_at(8))
    with pytest.raises(Interrupted):
        tr.fit()
    assert seen == [(False, True), (False, True)]
    ck = Checkpointer(out / "checkpoints")
    assert ck.latest() == 4
    assert ck.load(4)["cursor"] == {"epoch": 0, "next_batch": 4}
    resumed = sven.Trainer(None, [*over, "train.resume=true"]).fit()
    for key in METRICS:
        assert resumed[key] == reference[key], key


def _node_bytes(run: Path) -> tuple[int, int]:
    """Bytes of node-state files in a run folder: counting each inode once, and each
    path."""
    inodes, paths = {}, 0
    for p in run.rglob("nodes/rank*/*.npy"):
        st = p.stat()
        inodes[(st.st_dev, st.st_ino)] = st.st_size
        paths += st.st_size
    return sum(inodes.values()), paths


def test_a_run_folder_holds_the_node_state_once(store, tmp_path) -> None:
    run = tmp_path / "run"
    over = _overrides(store, run, "train.epochs=1", "train.keep_latest_k=1")
    summary = sven.Trainer(None, over).fit()
    (latest,) = (run / "checkpoints").glob("step-*")
    best = run / "best" / "step-000000000"
    files = sorted(p.relative_to(best) for p in (best / "nodes").rglob("*.npy"))
    assert [str(f) for f in files] == [
        f"nodes/rank0/{k}.npy" for k in ("last_update", "mail", "mail_ts", "mail_valid", "memory")
    ]
    for f in files:
        assert (best / f).stat().st_ino == (latest / f).stat().st_ino, f
    once, total = _node_bytes(run)
    assert total == 2 * once
    # One copy: 40 rows of each field, plus one 128-byte .npy header per file.
    fields = read_meta(latest)["node_state"]["fields"]
    assert fields["memory"] == {"dtype": "float32", "row_shape": [8]}
    one = sum(
        128 + 40 * np.dtype(f["dtype"]).itemsize * int(np.prod(f["row_shape"]))
        for f in fields.values()
    )
    assert once == one
    # The best model reproduces the run's test metrics.
    res = sven.Trainer(None, [*over, f"out={tmp_path / 'eval'}"]).evaluate_checkpoint(run)
    for key in ("test_ap", "test_auc"):
        assert res[key] == summary[key], key


def _to_format1(folder: Path, dest: Path) -> None:
    """Rewrites a format-2 checkpoint the way Sven 0.1 wrote it: ``memory-rank{r}.pt``
    shards, the owner map in ``state.pt``, plain sha256 digests, no ``format`` key."""
    meta = read_meta(folder)
    state = read_state(folder)
    state["data"]["owner"] = state["data"]["owner"].contiguous()
    dest.mkdir(parents=True)
    torch.save(state, dest / "state.pt")
    fields = meta["node_state"]["fields"]
    for r in range(meta["world_size"]):
        shard = load_file(folder / f"rank{r}.pt")
        base = folder / "nodes" / f"rank{r}"
        mem = {k: torch.from_numpy(np.load(base / f"{k}.npy")) for k in fields}
        torch.save({"memory": mem, **shard}, dest / f"memory-rank{r}.pt")
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dest.glob("*.pt")}
    old = {"step": meta["step"], "world_size": meta["world_size"], "files": files, "created": 0}
    (dest / "meta.json").write_text(json.dumps(old))


def test_format1_checkpoints_still_evaluate_and_resume(store, tmp_path, reference, capsys) -> None:
    out = tmp_path / "run"
    over = _overrides(store, out, "train.checkpoint_every=4")
    tr = sven.Trainer(None, over)
    tr.add_hook("before_step", die_at(8))
    with pytest.raises(Interrupted):
        tr.fit()
    ck = Checkpointer(out / "checkpoints")
    step = ck.latest()
    _to_format1(ck.path(step), tmp_path / "v1")
    shutil.rmtree(ck.path(step))
    (tmp_path / "v1").rename(ck.path(step))
    assert "format" not in json.loads((ck.path(step) / "meta.json").read_text())
    assert ck.verify(step)
    resumed = sven.Trainer(None, [*over, "train.resume=true"]).fit()
    for key in METRICS:
        assert resumed[key] == reference[key], key
    # The best model, rewritten in format 1, is evaluated to the run's own figures.
    best = Checkpointer(out / "best")
    old = tmp_path / "v1-best" / "step-000000001"
    _to_format1(best.path(best.latest()), old)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(old), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("test_ap", "test_auc"):
        assert res[key] == pytest.approx(resumed[key], abs=1e-12), key


def test_a_failed_best_model_makes_test_na_and_the_run_still_reports(
    store, tmp_path, monkeypatch, capsys
) -> None:
    """Epoch 0 is the best and its checkpoint fails (a full disk); epoch 1 trains on, so
    test has no best model to reload: its metrics are n/a, said in one line, and the run
    ends with the summary written and exit code 5."""
    monkeypatch.setattr(link_mod, "improved", lambda select, val, best: best["best_epoch"] < 0)
    run = tmp_path / "run"
    tr = sven.Trainer(None, _overrides(store, run))

    def full_disk(folder: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    tr.checkpoints.best.before_commit = full_disk
    with pytest.raises(CheckpointError) as info:
        tr.fit()
    err = capsys.readouterr().err
    best0 = run / "best" / "step-000000000"
    assert str(info.value) == (
        f"checkpoint {best0} (step 0) was not written: No space left on device (ENOSPC); "
        f"there is no older checkpoint under {run / 'best'}; the run's metrics and "
        f"checkpoint_errors are in {run / 'summary.json'}"
    )
    assert "test metrics are n/a: the best model (epoch 0) could not be written" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_epoch"] == 0 and summary["epochs_run"] == 2
    assert summary["test_ap"] is None and summary["val_ap"] is not None
    assert len(summary["checkpoint_errors"]) == 1
    assert Checkpointer(run / "checkpoints").latest() is not None
    assert not list((run / "best").glob(".tmp-*")) and not list((run / "best").glob("step-*"))


def _limit_file_size(limit: int):
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_a_write_past_the_file_size_limit_loses_nothing(wide_store, tmp_path) -> None:
    """Under ``ulimit -f`` between the small files and a node-state file, Python gets
    EFBIG: one line says which checkpoint is missing and why, no partial folder stays,
    summary.json has the metrics, and the exit status is 5."""
    run = tmp_path / "run"
    args = [
        "train",
        *_overrides(wide_store, run, "train.epochs=1", "model.memory_dim=16", "quiet=false"),
    ]
    limit = 1 << 20  # memory.npy is 20,000 x 16 float32: 1.28 MB
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [*SVEN, *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_file_size(limit),
        env=env,
    )
    assert done.returncode == 5, done.stderr
    assert "Traceback" not in done.stderr
    said = [x for x in done.stderr.splitlines() if "was not written" in x]
    assert len(said) == 1, done.stderr
    # The epoch-end checkpoint's step: the epoch's batches, plus one.
    lo, hi = TemporalEvents.load(wide_store).split_range("train")
    step = -(-(hi - lo) // 50) + 1
    latest = run / "checkpoints" / f"step-{step:09d}"
    assert said[0].startswith(
        f"sven: error: checkpoint {latest} (step {step}) was not written: File too "
        "large (EFBIG) writing nodes/rank0/memory.npy; there is no older checkpoint under "
    ), said[0]
    assert said[0].endswith(
        f"(and 1 more); the run's metrics and checkpoint_errors are in {run / 'summary.json'}"
    )
    summary = json.loads((run / "summary.json").read_text())
    assert isinstance(summary["test_ap"], float) and isinstance(summary["val_ap"], float)
    assert [e.split(" was not written")[0] for e in summary["checkpoint_errors"]] == [
        f"checkpoint {latest} (step {step})",
        f"checkpoint {run / 'best' / 'step-000000000'} (step 0)",
    ]
    leftovers = [p for p in run.rglob("*") if p.name.startswith((".tmp", "step-"))]
    assert leftovers == []
