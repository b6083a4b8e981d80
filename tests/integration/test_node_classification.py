"""`sven train task=node_classification` on a stream whose labels are a known function of
its history.

Each round every user acts once (in a random order), so a batch of one round's size holds
each user once and the previous event of a user is always in memory. An event's label is
1 iff the user's previous event was with one of the "bad" items, which the event's edge
feature marks: a classifier on a memory model's embeddings must find it (AUC near 1),
and on shuffled labels must not (AUC near 0.5).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sven.cli import main
from sven.config import load_config
from sven.datasets.store import write_events
from sven.tasks.nodeclass import NodeClassification

USERS, ROUNDS, ITEMS = 50, 80, 20


def _stream(out: Path, *, shuffle: bool = False, labels: str = "history") -> Path:
    rng = np.random.default_rng(0)
    src = np.concatenate([rng.permutation(USERS) for _ in range(ROUNDS)])
    e = src.size
    dst = USERS + rng.integers(0, ITEMS, e)
    flag = (dst - USERS < 5).astype(np.float32)  # the "bad" items
    feat = np.stack([flag, rng.random(e).astype(np.float32)], 1)
    label = np.zeros(e, dtype=np.int64)
    last = np.full(USERS, -1)
    for i, u in enumerate(src):
        label[i] = int(last[u] >= 0 and flag[last[u]] == 1)
        last[u] = i
    if shuffle:
        label = rng.permutation(label)
    if labels == "none":
        write_events(out, src, dst, 10 * np.arange(e), edge_feat=feat, name="nc")
    else:
        if labels == "multi":
            label = label + (np.arange(e) % 3 == 0)
        write_events(out, src, dst, 10 * np.arange(e), edge_feat=feat, label=label, name="nc")
    return out


def _overrides(store: Path, out: Path, *extra: str) -> list[str]:
    return [
        "task=node_classification",
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",
        "train.threads=1",
        "quiet=true",
        "train.epochs=1",
        f"train.batch_size={USERS}",
        "train.lr=0.001",
        "model.memory_dim=16",
        "model.time_dim=8",
        "model.embed_dim=16",
        "model.num_neighbors=5",
        "nc.lr=0.01",
        "nc.epochs=30",
        "nc.patience=0",
        *extra,
    ]


def _fit(*overrides: str) -> dict:
    return NodeClassification(load_config(None, list(overrides))).fit()


@pytest.fixture(scope="module")
def jodie_run(tmp_path_factory) -> tuple[Path, dict]:
    """JODIE's encoder trained in the same command, then the frozen classifier."""
    root = tmp_path_factory.mktemp("nc")
    store = _stream(root / "labelled")
    run = root / "run"
    assert main(["train", *_overrides(store, run, "model.name=jodie")]) == 0
    return run, json.loads((run / "summary.json").read_text())


def test_frozen_classifier_finds_the_label(jodie_run) -> None:
    run, summary = jodie_run
    assert summary["task"] == "node_classification" and not summary["finetune"]
    assert summary["test_auc"] > 0.9 and summary["val_auc"] > 0.9
    assert summary["encoder"].startswith(str(run / "encoder"))
    # The encoder is a link-prediction run of its own, trained first.
    lp = json.loads((run / "encoder" / "summary.json").read_text())
    assert lp["model"] == "jodie" and "test_ap" in lp
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == list(range(30))
    best = max(lines, key=lambda x: x["val_auc"])
    assert summary["best_epoch"] == best["epoch"] and summary["test_auc"] == best["test_auc"]
    assert summary["test_events"] == 600 and summary["test_positives"] > 100


def test_shuffled_labels_give_chance(jodie_run, tmp_path) -> None:
    run, _ = jodie_run
    store = _stream(tmp_path / "shuffled", shuffle=True)
    s = _fit(*_overrides(store, tmp_path / "ctl", "model.name=jodie", f"nc.encoder={run}/encoder"))
    assert abs(s["test_auc"] - 0.5) < 0.1


def test_finetuned_tgn_finds_the_label(tmp_path) -> None:
    store = _stream(tmp_path / "labelled")
    s = _fit(*_overrides(store, tmp_path / "ft", "nc.finetune=true", "nc.epochs=8"))
    assert s["finetune"] and s["test_auc"] > 0.9


def test_resume_continues_exactly(jodie_run, tmp_path) -> None:
    run, _ = jodie_run
    store = _stream(tmp_path / "labelled")
    # A node-classification run stands for its (frozen) encoder.
    enc = f"nc.encoder={run}"
    full = _fit(*_overrides(store, tmp_path / "full", "model.name=jodie", enc, "nc.epochs=6"))
    part = _overrides(store, tmp_path / "part", "model.name=jodie", enc)
    _fit(*part, "nc.epochs=3")
    resumed = _fit(*part, "nc.epochs=6", "train.resume=true")
    for k in ("train_auc", "val_auc", "test_auc", "best_epoch", "epochs_run"):
        assert resumed[k] == full[k], k
    a = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    b = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    drop = ("epoch_s",)
    assert [{k: v for k, v in json.loads(x).items() if k not in drop} for x in a] == [
        {k: v for k, v in json.loads(x).items() if k not in drop} for x in b
    ]


@pytest.mark.parametrize("labels", ["none", "multi"])
def test_stores_without_binary_labels_are_refused(jodie_run, tmp_path, capsys, labels) -> None:
    run, _ = jodie_run
    store = _stream(tmp_path / labels, labels=labels)
    enc = f"nc.encoder={run}/encoder"
    argv = ["train", *_overrides(store, tmp_path / "r", "model.name=jodie", enc)]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert ("has none" if labels == "none" else "binary labels") in err


def test_encoder_of_another_dataset_is_refused(jodie_run, tmp_path, capsys) -> None:
    run, _ = jodie_run
    rng = np.random.default_rng(1)
    other = tmp_path / "other"
    write_events(other, rng.integers(0, 9, 300), rng.integers(0, 9, 300), np.arange(300),
                 label=np.zeros(300, dtype=np.int64))  # fmt: skip
    argv = ["train", *_overrides(other, tmp_path / "r", "model.name=jodie", f"nc.encoder={run}")]
    assert main(argv) == 1
    assert "trained on another dataset" in capsys.readouterr().err


def test_sven_eval_points_a_node_classification_run_to_its_encoder(jodie_run, capsys) -> None:
    run, _ = jodie_run
    assert main(["eval", "--checkpoint", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "node-classification run" in err and "encoder" in err
