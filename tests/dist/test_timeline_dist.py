"""The timeline and the Chrome traces of two gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sven
from tests.dist.launch import run_ranks
from tests.integration.test_timeline_train import check_timeline

pytestmark = pytest.mark.dist

# Two ranks: the exchange's id and row stages and the gradient all-reduce appear.
TWO_RANKS = {
    "wait",
    "sample",
    "id_exchange",
    "row_fetch",
    "compute",
    "grad_allreduce",
    "optimizer",
    "write_back",
}


def _train(rank: int, world_size: int, store: str, out: str) -> None:
    over = [
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",
        "quiet=true",
        "train.epochs=1",
        "train.batch_size=100",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=3",
        "train.threads=1",
        "dist.timeout_s=60",
        "profile=true",
        "log.profile_start=1",
        "log.profile_steps=2",
    ]
    sven.Trainer(None, over).fit()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from sven.datasets.synth import generate

    path = tmp_path_factory.mktemp("tl") / "store"
    generate(path, events=1500, nodes=60, seed=3)
    return str(path)


def test_two_rank_timeline_and_traces(store: str, tmp_path: Path) -> None:
    run_ranks(_train, 2, store, str(tmp_path), timeout=300)
    check_timeline(tmp_path, TWO_RANKS, 2)
    for rank in (0, 1):
        trace = json.loads((tmp_path / "traces" / f"rank{rank}.json").read_text())
        names = {ev.get("name", "") for ev in trace["traceEvents"]}
        assert {n for n in names if n.startswith("sven_step#")} == {"sven_step#1", "sven_step#2"}
        # The exchange and the all-reduce are in the trace of each rank.
        assert any("all_to_all" in n for n in names), rank
        assert any("all_reduce" in n for n in names), rank
