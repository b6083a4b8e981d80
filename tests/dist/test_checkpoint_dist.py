"""A checkpoint written by two gloo ranks, read by one process: "train on 2, predict on 1".

The two ranks train (float64), then evaluate the best checkpoint and replay the stream
on two ranks; one process then reads the same checkpoint: every vertex's node state as
the rank that owned it wrote it, the same test metrics, the same predictions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import sven
from sven.cli import main
from sven.datasets.store import TemporalEvents
from sven.engine.checkpoint import find_checkpoint, load_node_state, read_meta, read_state
from tests.dist.launch import run_ranks
from tests.dist.test_dist_train import _overrides as _tiny

pytestmark = pytest.mark.dist

NODES = 90


def _overrides(store: str, out: str, *extra: str) -> list[str]:
    # test_dist_train's tiny model, in float64 for one epoch, a checkpoint mid-epoch.
    more = ("train.dtype=float64", "train.epochs=1", "train.checkpoint_every=5")
    return _tiny(store, out, *more, *extra)


def _best_test_logits(tr: sven.Trainer, run: str) -> torch.Tensor:
    """The test split's positive logits from the best model and its saved node state
    (what the run's test scored), in global event order, on this trainer's ranks."""
    folder = find_checkpoint(run)
    tr.model.load_state_dict(read_state(folder)["model"])
    load_node_state(folder, tr.memory.state_dict(), tr.owned, tr.num_nodes)
    return tr.evaluate("test").pos.cpu()


def _two_ranks(rank: int, world_size: int, store: str, out: str) -> dict:
    run = f"{out}/run"
    tr = sven.Trainer(None, _overrides(store, run))
    summary = tr.fit()
    folder = find_checkpoint(run)
    ev = sven.Trainer(None, _overrides(store, f"{out}/eval2"))
    try:
        again = ev.evaluate_checkpoint(run)
        logits = _best_test_logits(ev, run)
    finally:
        ev.ctx.teardown()
    shard = {
        k: torch.from_numpy(np.load(folder / "nodes" / f"rank{rank}" / f"{k}.npy"))
        for k in read_meta(folder)["node_state"]["fields"]
    }
    return {
        "summary": summary,
        "again": again,
        "owned": tr.owned.cpu(),
        "shard": shard,
        "logits": logits,
        "folder": str(folder),
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[str, Path, list[dict]]:
    from sven.datasets.synth import generate

    root = tmp_path_factory.mktemp("ck2")
    store = str(root / "store")
    generate(store, events=2500, nodes=NODES, seed=5, edge_feat_dim=2)
    return store, root, run_ranks(_two_ranks, 2, store, str(root), timeout=600)


def test_one_process_reads_each_vertex_as_its_owner_wrote_it(two) -> None:
    _, _, ranks = two
    folder = Path(ranks[0]["folder"])
    meta = read_meta(folder)
    assert meta["world_size"] == 2 and meta["node_state"]["num_nodes"] == NODES
    rows = [r["owned"].numel() for r in ranks]
    assert meta["node_state"]["rows"] == rows and sum(rows) == NODES
    owned = torch.cat([r["owned"] for r in ranks])
    assert torch.equal(owned.sort().values, torch.arange(NODES))
    fields = ranks[0]["shard"]
    dest = {k: torch.full((NODES, *v.shape[1:]), 7, dtype=v.dtype) for k, v in fields.items()}
    load_node_state(folder, dest, torch.arange(NODES), num_nodes=NODES)
    for r in ranks:
        for k, v in r["shard"].items():
            assert torch.equal(dest[k][r["owned"]], v), k
    assert float(dest["memory"].abs().sum()) > 0  # trained, not empty


def test_one_process_evaluates_it_to_the_two_rank_figures(two, tmp_path) -> None:
    store, _, ranks = two
    summary, again = ranks[0]["summary"], ranks[0]["again"]
    one = sven.Trainer(None, _overrides(store, str(tmp_path / "one")))
    res = one.evaluate_checkpoint(Path(ranks[0]["folder"]).parents[1])
    for key in ("test_ap", "test_auc", "test_ap_pooled"):
        # 2 ranks -> 2 ranks and 2 ranks -> 1 process: the run's own figures.
        assert again[key] == pytest.approx(summary[key], abs=1e-12), key
        assert res[key] == pytest.approx(summary[key], abs=1e-12), key
    # Event by event: the scores of the two ranks, on one process.
    mine = _best_test_logits(one, str(Path(ranks[0]["folder"]).parents[1]))
    assert mine.shape == ranks[0]["logits"].shape
    torch.testing.assert_close(mine, ranks[0]["logits"], rtol=0, atol=1e-12)


def test_sven_predict_on_one_process_gives_the_two_rank_scores(two, tmp_path) -> None:
    store, root, ranks = two
    ev = TemporalEvents.load(store)
    lo, hi = ev.split_range("test")
    raw = np.asarray(ev.id_map)
    pairs = pd.DataFrame(
        {
            "src": raw[np.asarray(ev.src[lo:hi])],
            "dst": raw[np.asarray(ev.dst[lo:hi])],
            "t": np.asarray(ev.t[lo:hi]),
        }
    )
    pairs.to_csv(tmp_path / "pairs.csv", index=False)
    out = tmp_path / "scored.csv"
    argv = ["predict", "--checkpoint", str(root / "run"), "--pairs", str(tmp_path / "pairs.csv")]
    assert main([*argv, "--out", str(out), "--device", "cpu", "--memory", "replay"]) == 0
    got = pd.read_csv(out)
    assert len(got) == hi - lo
    # What evaluation scores with the two-rank model and the memory replayed from empty
    # (the memory a prediction is made from).
    tr = sven.Trainer(None, _overrides(store, str(tmp_path / "one")))
    tr.model.load_state_dict(read_state(find_checkpoint(root / "run"))["model"])
    tr.memory.reset()
    tr.evaluate("train")
    tr.evaluate("val")
    want = torch.sigmoid(tr.evaluate("test").pos).numpy()
    # Scores are written as float32.
    np.testing.assert_allclose(got["score"].to_numpy(), want, rtol=0, atol=2e-7)
    assert json.loads((root / "run" / "summary.json").read_text())["world_size"] == 2
    # From the node state the two ranks saved (the default), read on one process
    # through their owner map: the first test batch scores as the two ranks' test did.
    b = tr.cfg.train.batch_size
    stored = tmp_path / "stored.csv"
    assert main([*argv, "--out", str(stored), "--device", "cpu"]) == 0
    first = pd.read_csv(stored)["score"].to_numpy()[:b]
    np.testing.assert_allclose(
        first, torch.sigmoid(ranks[0]["logits"][:b]).numpy(), rtol=0, atol=2e-7
    )
