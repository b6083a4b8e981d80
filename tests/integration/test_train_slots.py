"""Node slots planned for training (``Step.plan_train_slots``).

A fixed-shape training batch de-duplicates its ids into slots; without a plan they hold
every id the batch lists. Training's negatives and uniform draws depend on the epoch, so
the plan replays every batch of every epoch the run trains: the slots then hold the
most distinct nodes any of them reads, and the step (CUDA's fixed-shape step, forced
here on the CPU) trains as the unplanned one does, to the last bit, resumed or not.
"""

from __future__ import annotations

import json

import pytest

import sven
from sven.engine.capacities import (
    batch_node_counts,
    plan_epoch_slots,
    plan_slots,
    plan_slots_at_once,
)
from tests.conftest import (
    distinct_counts,
    interrupted_then_resumed,
    most_distinct,
    write_tiny_store,
)

EPOCHS = 3
B = 64
METRICS = ("val_ap", "val_auc", "test_ap", "test_auc", "test_ap_inductive")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("train_slots") / "store"
    # 2,000 nodes: far more than a batch reads, so the plan is below N + 1.
    return write_tiny_store(path, events=900, nodes=2000, seed=5, t_max=300, edge_dim=3)


@pytest.fixture
def fixed(monkeypatch):
    monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)


def _overrides(store, out, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",
        "train.threads=1",
        "quiet=true",
        f"train.epochs={EPOCHS}",
        f"train.batch_size={B}",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=3",
        "model.sampling=uniform",
        "model.dropout=0.1",
        *extra,
    ]


def _distinct_oracle(tr: sven.Trainer, epoch: int) -> int:
    """The most distinct nodes a training batch of ``epoch`` reads."""
    return most_distinct(tr, *tr.ranges["train"], epoch, tr.cfg.train.num_neg)


@pytest.mark.parametrize("model", ["tgn", "jodie"])
def test_planned_training_slots_hold_the_most_distinct_nodes_of_every_epoch(
    store, tmp_path, fixed, model: str
) -> None:
    tr = sven.Trainer(f"configs/{model}.yaml", _overrides(store, tmp_path))
    # As a run resumed in its last epoch: the plan still covers every epoch.
    tr.step.plan_capacities(EPOCHS - 1)
    per_epoch = [_distinct_oracle(tr, e) for e in range(EPOCHS)]
    # The distinct nodes and the padding id.
    assert tr.step.source.slots["train"] == max(per_epoch) + 1
    assert max(per_epoch) + 1 < tr.data.events.num_nodes + 1


@pytest.mark.parametrize(
    ("model", "sampling", "num_neg"),
    [
        ("tgn", "uniform", 1),
        ("tgn", "recent", 3),
        ("jodie", "uniform", 2),
        ("apan", "uniform", 1),
        ("apan", "recent", 2),
        ("dyrep", "recent", 1),
        ("dyrep", "uniform", 3),
    ],
)
@pytest.mark.parametrize("dense", [True, False])
def test_slots_planned_at_once_equal_the_replay_of_every_batch(
    store, tmp_path, fixed, monkeypatch, model: str, sampling: str, num_neg: int, dense: bool
) -> None:
    over = _overrides(store, tmp_path, f"model.sampling={sampling}", f"train.num_neg={num_neg}")
    tr = sven.Trainer(f"configs/{model}.yaml", over)
    lo, hi = tr.ranges["train"]
    assert (hi - lo) % B, "the last batch is padded"
    passes = [lambda e=e: (lo, hi, e, num_neg, None) for e in range(EPOCHS)]
    replayed = plan_slots(tr.step.source, tr.step.ahead, B, passes)
    if not dense:
        # Counted by sorting the (batch, id) keys: the way of graphs with many nodes.
        monkeypatch.setattr("sven.engine.capacities.DENSE_NODES", 0)
    for ids in (1 << 22, B * (2 + num_neg) * 4 * 3):
        # All the epoch's batches at once, and a few at a time (3 with 3 neighbours
        # read, 12 without; the last run short).
        monkeypatch.setattr("sven.engine.capacities.PLAN_IDS", ids)
        assert plan_slots_at_once(tr.step.source, B, passes) == replayed
        # The positive roots' ids counted once per run of batches (recent sampling).
        assert plan_epoch_slots(tr.step.source, B, lo, hi, EPOCHS, num_neg) == replayed
    assert replayed < tr.data.events.num_nodes + 1


@pytest.mark.parametrize(("model", "sampling"), [("tgn", "recent"), ("jodie", "uniform")])
@pytest.mark.parametrize("dense", [True, False])
def test_batch_node_counts_are_each_batchs_distinct_nodes(
    store, tmp_path, monkeypatch, model: str, sampling: str, dense: bool
) -> None:
    """The rows each training batch reads (benchmarks/batch_rows.py), batch by batch:
    those of the exact-size build, in every epoch (negatives depend on it)."""
    tr = sven.Trainer(
        f"configs/{model}.yaml", _overrides(store, tmp_path, f"model.sampling={sampling}")
    )
    lo, hi = tr.ranges["train"]
    if not dense:
        monkeypatch.setattr("sven.engine.capacities.DENSE_NODES", 0)
    # A few batches at a time: runs of batches, the last one short.
    monkeypatch.setattr("sven.engine.capacities.PLAN_IDS", B * 3 * 4 * 3)
    for epoch in range(2):
        got = batch_node_counts(tr.step.source, B, lo, hi, epoch, tr.cfg.train.num_neg)
        assert got.tolist() == distinct_counts(tr, lo, hi, epoch, tr.cfg.train.num_neg)


def _history(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _first_loss(store, out, model: str) -> tuple[float, int]:
    """The loss of the first training batch and the training slots."""
    tr = sven.Trainer(f"configs/{model}.yaml", _overrides(store, out))
    tr.step.plan_capacities(0)
    tr.step.start_epoch(0, 0, 1)
    lo, hi = tr.ranges["train"]
    tr.step.train_batch(0, 0, lo, min(lo + B, hi))
    return tr.step.take_loss(), tr.step.source.slots.get("train", 0)


@pytest.mark.parametrize("model", ["tgn", "jodie"])
def test_planned_training_slots_train_as_the_default_slots(
    store, tmp_path, fixed, monkeypatch, model: str
) -> None:
    loss_p, u = _first_loss(store, tmp_path / "p1", model)
    planned = sven.Trainer(f"configs/{model}.yaml", _overrides(store, tmp_path / "p"))
    res_p = planned.fit()
    with monkeypatch.context() as m:
        # No plan: training's slots hold every id a batch lists.
        m.setattr("sven.engine.step.plan_epoch_slots", lambda *a, **k: 1 << 40)
        loss_f, full_u = _first_loss(store, tmp_path / "f1", model)
        res_f = sven.Trainer(f"configs/{model}.yaml", _overrides(store, tmp_path / "f")).fit()
    assert u < full_u
    # The forward computes each slot's row alone: the empty slots change nothing.
    assert loss_p == loss_f
    # A weight gradient sums over the slots, in blocks that follow their count (the
    # CPU's GEMM): the updates differ in the last bits.
    for a, b in zip(_history(tmp_path / "p"), _history(tmp_path / "f"), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
    for key in METRICS:
        assert res_p[key] == pytest.approx(res_f[key], abs=1e-4), key


def test_resume_with_planned_training_slots_is_exact(store, tmp_path, fixed) -> None:
    extra = ("train.checkpoint_every=4",)
    ref = sven.Trainer("configs/tgn.yaml", _overrides(store, tmp_path / "ref", *extra)).fit()
    # Dies in epoch 1, past a checkpoint.
    run = _overrides(store, tmp_path / "run", *extra)
    res = interrupted_then_resumed("configs/tgn.yaml", run, 15)
    for key in METRICS:
        assert res[key] == ref[key], key
    history = _history(tmp_path / "run")
    assert [h["epoch"] for h in history] == list(range(EPOCHS))
    assert [h["train_loss"] for h in history] == [
        h["train_loss"] for h in _history(tmp_path / "ref")
    ]
