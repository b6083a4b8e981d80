"""Node classification on P ranks gives one process's figures.

The encoder is trained in the same command on the ranks, then the stream is replayed
through it on the ranks (each its share of a batch, memory through the exchange) and
the embeddings gathered by event index; in float64 the AUCs match one process's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sven.config import load_config
from sven.errors import ConfigError
from sven.tasks.nodeclass import NodeClassification
from tests.dist.launch import run_ranks
from tests.integration.test_node_classification import _overrides, _stream

pytestmark = pytest.mark.dist


def _args(store: str, out: str) -> list[str]:
    extra = ("model.name=jodie", "train.dtype=float64", "nc.epochs=5", "dist.strategy=hash")
    return [*_overrides(Path(store), Path(out), *extra), "dist.timeout_s=60"]


def _rank_main(rank: int, world_size: int, store: str, out: str) -> dict | None:
    with pytest.raises(ConfigError, match="one process"):
        NodeClassification(load_config(None, [*_args(store, out), "nc.finetune=true"]))
    summary = NodeClassification(load_config(None, _args(store, out))).fit()
    return summary if rank == 0 else None


def test_two_ranks_equal_one_process(tmp_path) -> None:
    store = str(_stream(tmp_path / "labelled"))
    ref = NodeClassification(load_config(None, _args(store, str(tmp_path / "one")))).fit()
    got = run_ranks(_rank_main, 2, store, str(tmp_path / "two"), timeout=600)[0]
    assert got["world_size"] == 2 and ref["world_size"] == 1
    assert ref["test_auc"] > 0.8
    for k in ("train_auc", "val_auc", "test_auc"):
        assert got[k] == pytest.approx(ref[k], abs=1e-9), k
    assert got["best_epoch"] == ref["best_epoch"]
    assert (tmp_path / "two" / "encoder" / "summary.json").is_file()
    assert (tmp_path / "two" / "summary.json").is_file()
    # A model trained on two ranks answers on one process, as the one trained on one.
    from sven.tasks.predict import Predictor

    src, dst, t = [0, 1, 2], [50, 51, 52], [1000.0, 20000.0, 39000.0]
    one = Predictor(tmp_path / "one" / "encoder", device="cpu").score(src, dst, t)
    two = Predictor(tmp_path / "two" / "encoder", device="cpu").score(src, dst, t)
    np.testing.assert_allclose(two, one, atol=1e-6)
