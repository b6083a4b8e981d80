"""MRR on P ranks: fixed (stored) and sampled negatives give one process's figures.

The MRR negatives are looked up (fixed) or drawn (sampled) by global event index, so
every rank layout scores the same negatives; with float64 the MRR must match.
"""

from __future__ import annotations

import numpy as np
import pytest

import sven
from tests.dist.launch import run_ranks

pytestmark = pytest.mark.dist

SOURCES = (("fixed",), ("sampled", "eval.mrr_negatives=7"))


def _overrides(store: str, out: str, source: str, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        f"eval.mrr_source={source}",
        "model.name=tgn",
        "dist.strategy=hash",
        "quiet=true",
        "train.epochs=1",
        "train.max_batches=8",
        "train.batch_size=50",
        "train.dtype=float64",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=4",
        "train.threads=1",
        "dist.timeout_s=60",
        *extra,
    ]


def _fit(store: str, out: str) -> dict:
    return {
        case[0]: sven.Trainer(None, _overrides(store, f"{out}/{case[0]}", *case)).fit()
        for case in SOURCES
    }


def _rank_main(rank: int, world_size: int, store: str, out: str) -> dict | None:
    res = _fit(store, out)
    return res if rank == 0 else None


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A synthetic stream with fixed negatives of val and test (ragged: -1 padded)."""
    from sven.datasets.negatives import write_eval_negatives
    from sven.datasets.store import TemporalEvents
    from sven.datasets.synth import generate

    path = tmp_path_factory.mktemp("mrr") / "synth"
    generate(path, events=1200, nodes=60, seed=5)
    ev = TemporalEvents.load(path)
    rng = np.random.default_rng(1)
    for split, q in (("val", 9), ("test", 12)):
        lo, hi = ev.split_range(split)
        neg = rng.integers(0, ev.num_nodes, (hi - lo, q))
        neg[rng.random((hi - lo, q)) < 0.2] = -1
        neg[:, 0] = np.asarray(ev.dst[lo:hi])  # true edges: TGB's filter drops them
        write_eval_negatives(path, split, neg, {"path": "synthetic"})
    return str(path)


def test_mrr_on_two_ranks_equals_one_process(store, tmp_path) -> None:
    ref = _fit(store, str(tmp_path / "one"))
    got = run_ranks(_rank_main, 2, store, str(tmp_path / "two"), timeout=600)[0]
    assert ref["fixed"]["eval_mrr_source"] == "fixed"
    assert ref["fixed"]["eval_mrr_negatives"] == 12
    assert ref["sampled"]["eval_mrr_source"] == "sampled"
    for source in ("fixed", "sampled"):
        a, b = got[source], ref[source]
        assert a["world_size"] == 2 and a["eval_mrr_source"] == source
        assert 0.0 < b["test_mrr"] < 1.0
        assert a["test_mrr"] == pytest.approx(b["test_mrr"], rel=1e-9), source
    # Fixed and sampled negatives differ: the two figures are not one computation.
    assert ref["fixed"]["test_mrr"] != ref["sampled"]["test_mrr"]
