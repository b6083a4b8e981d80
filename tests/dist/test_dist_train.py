"""Distributed runs end to end: exact resume, evaluation of sharded checkpoints, and
measured communication equal to the partition cost model's prediction."""

from __future__ import annotations

import json

import pytest

import sven
from sven.cli import main
from tests.conftest import Interrupted, die_at
from tests.dist.launch import run_ranks

pytestmark = pytest.mark.dist

METRICS = ("val_ap", "val_auc", "test_ap", "test_auc", "test_ap_inductive", "test_auc_inductive")


def _overrides(store: str, out: str, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",  # gloo ranks, as the harness starts them
        "quiet=true",
        "train.epochs=2",
        "train.batch_size=100",
        "model.dropout=0.0",
        "model.sampling=recent",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=4",
        "model.mailbox_size=3",
        "train.threads=1",
        "dist.timeout_s=60",
        "dist.strategy=minmax",
        *extra,
    ]


def _resume_main(rank: int, world_size: int, store: str, out: str) -> dict | None:
    extra = ("train.checkpoint_every=5",)
    ref = sven.Trainer(None, _overrides(store, f"{out}/ref", *extra)).fit()
    try:
        dying = sven.Trainer(None, _overrides(store, f"{out}/run", *extra))
        dying.add_hook("before_step", die_at(19))
        dying.fit()
    except Interrupted:
        pass
    resumed = sven.Trainer(None, _overrides(store, f"{out}/run", *extra, "train.resume=true")).fit()
    return {"ref": ref, "resumed": resumed} if rank == 0 else None


def _comm_main(
    rank: int, world_size: int, store: str, out: str, model: str, sampling: str = "recent"
) -> dict:
    extra = (f"model.name={model}", "train.epochs=1", f"model.sampling={sampling}")
    tr = sven.Trainer(None, _overrides(store, f"{out}/{model}", *extra))
    steps: list[int] = []
    tr.add_hook("after_step", lambda t: steps.append(1))
    tr.fit()
    return {"steps": len(steps), "bucket_bytes": tr.grads.bytes_per_step}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from sven.datasets.synth import generate

    path = tmp_path_factory.mktemp("dt") / "store"
    generate(path, events=2500, nodes=90, seed=5, edge_feat_dim=2)
    return str(path)


def test_two_rank_resume_is_exact(store, tmp_path) -> None:
    res = run_ranks(_resume_main, 2, store, str(tmp_path), timeout=600)[0]
    for key in METRICS:
        assert res["resumed"][key] == res["ref"][key], key
    assert res["resumed"]["comm_bytes"] == res["ref"]["comm_bytes"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1]
    # A 2-rank checkpoint is evaluated on one process from its memory shards.
    ckpt = tmp_path / "run"
    best = next((ckpt / "best").glob("step-*"))
    assert sorted(p.name for p in (best / "nodes").glob("rank*")) == ["rank0", "rank1"]
    assert sorted(p.name for p in best.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]


def test_eval_of_sharded_checkpoint_reproduces_summary(store, tmp_path, capsys) -> None:
    run_ranks(_comm_main, 2, store, str(tmp_path), "tgn", timeout=600)
    summary = json.loads((tmp_path / "tgn" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert main(["eval", "--checkpoint", str(tmp_path / "tgn"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("test_ap", "test_auc", "test_ap_inductive"):
        assert res[key] == pytest.approx(summary[key], abs=1e-6), key


@pytest.mark.parametrize(
    ("model", "sampling"),
    [("tgn", "recent"), ("tgn", "uniform"), ("jodie", "recent"), ("dyrep", "uniform"),
     ("apan", "uniform")],
)  # fmt: skip
def test_measured_bytes_equal_cost_model(store, tmp_path, model: str, sampling: str) -> None:
    # Uniform draws are keyed by event and slot, so the replay draws what training drew.
    ranks = run_ranks(_comm_main, 2, store, str(tmp_path), model, sampling, timeout=600)
    summary = json.loads((tmp_path / model / "summary.json").read_text())
    # The gradient all-reduce: each rank sends 2 (P - 1) / P of the bucket per step.
    assert summary["comm_bytes_grads"] == sum(r["steps"] * r["bucket_bytes"] for r in ranks) > 0
    measured = summary["comm_bytes_measured_epoch0_per_rank"]
    assert measured == summary["comm_bytes_predicted_epoch0_per_rank"]
    assert (
        summary["comm_bytes_naive_measured_epoch0_per_rank"]
        == summary["comm_bytes_naive_predicted_epoch0_per_rank"]
    )
    assert sum(summary["comm_bytes_naive_measured_epoch0_per_rank"]) > sum(measured) > 0
