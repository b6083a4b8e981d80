"""Node slots planned per evaluation width (``sven.engine.capacities.plan_slots_at_once``).

A fixed-shape batch de-duplicates its ids into slots; without a plan they hold every
id the batch lists, up to the graph's N + 1. An evaluation width's batches are fixed by
the seed, so a replay finds the most distinct nodes any of them reads: the step then
runs on those slots (CUDA's fixed-shape step, forced here on the CPU) and scores every
event as the unplanned step does, to the last bit.
"""

from __future__ import annotations

import pytest
import torch

from sven.engine.capacities import plan_slots
from sven.engine.evaluation import EVAL_STREAM
from sven.engine.trainer import Trainer
from tests.conftest import most_distinct, write_tiny_store

SPLITS = ("val", "test")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("slots") / "store"
    # 2,000 nodes: far more than a batch reads, so the plan is below N + 1.
    return write_tiny_store(path, events=1200, nodes=2000, seed=3, t_max=300, edge_dim=3)


def _trained(store, run, model: str, mrr: int) -> Trainer:
    b = 64
    tr = Trainer(
        f"configs/{model}.yaml",
        [
            f"data.path={store}",
            f"out={run}",
            "train.device=cpu",
            "train.threads=1",
            "quiet=true",
            "train.epochs=1",
            f"train.batch_size={b}",
            "model.memory_dim=8",
            "model.time_dim=4",
            "model.embed_dim=8",
            "model.num_neighbors=3",
            f"eval.mrr_negatives={mrr}",
        ],
    )
    tr.step.plan_capacities(0)
    tr.step.start_epoch(0, 0, 6)
    lo, hi = tr.ranges["train"]
    for i, start in enumerate(range(lo, min(hi, lo + 6 * b), b)):
        tr.step.train_batch(0, i, start, min(start + b, hi))
    return tr


def _distinct_oracle(tr: Trainer, split: str) -> int:
    """The most distinct nodes a batch of ``split`` reads."""
    negs = tr.step.evaluation.negatives(split)
    return most_distinct(tr, *tr.ranges[split], EVAL_STREAM[split], negs.shape[1], negs)


def _replayed(tr: Trainer, w: int, splits: list[str]) -> int:
    """The slots of width ``w`` from the replay of every batch of ``splits``."""
    table = tr.step.evaluation.widths[w].neg

    def ready(split: str):
        def fn():
            lo, hi = tr.ranges[split]
            table[: hi - lo].copy_(tr.step.evaluation.negatives(split))
            return lo, hi, EVAL_STREAM[split], w, table

        return fn

    passes = [ready(s) for s in splits]
    return plan_slots(tr.step.source, tr.step.inp, tr.cfg.train.batch_size, passes)


@pytest.mark.parametrize(("model", "mrr"), [("tgn", 0), ("tgn", 20), ("jodie", 20)])
def test_planned_slots_score_as_the_unplanned_step(
    store, tmp_path, monkeypatch, model: str, mrr: int
) -> None:
    monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)
    planned = _trained(store, tmp_path / "planned", model, mrr)
    with monkeypatch.context() as m:
        # No plan: every kind of step at its default slots (N + 1 here).
        m.setattr("sven.engine.evaluation.plan_slots_at_once", lambda *a, **k: 1 << 40)
        full = _trained(store, tmp_path / "full", model, mrr)
    for split in SPLITS:
        a, b = planned.evaluate(split), full.evaluate(split)
        assert torch.equal(a.pos, b.pos) and torch.equal(a.neg, b.neg), split
        assert (a.mrr_neg is None) == (mrr == 0)
        if mrr:
            assert torch.equal(a.mrr_neg, b.mrr_neg), split
        assert planned.split_metrics(split, a) == full.split_metrics(split, b)
    ev = planned.step.evaluation
    for w in ev.widths:
        splits = [s for s in SPLITS if ev.split_width(s) == w]
        distinct = max(_distinct_oracle(planned, s) for s in splits)
        slots = planned.step.evaluation.source.slots[f"eval{w}"]
        # The distinct nodes and the padding id (one event's ids are fewer here).
        assert slots == distinct + 1
        assert slots == _replayed(planned, w, splits)
        assert slots < planned.data.events.num_nodes + 1
