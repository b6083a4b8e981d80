"""A checkpoint against the store it is applied to (sven.engine.store_check): the same
store passes, another one is refused in one line naming both, or noted where asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sven.config import load_config
from sven.datasets.identity import store_identity
from sven.engine.data import Data
from sven.engine.store_check import check_same_data, check_store_first
from sven.errors import SvenError
from tests.conftest import write_tiny_store


def _data(path: Path) -> Data:
    cfg = load_config(None, [f"data.path={path}", "train.device=cpu", "quiet=true"])
    return Data(
        cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
        agree=lambda v: v,
    )  # fmt: skip


@pytest.fixture
def two(tmp_path: Path) -> tuple[Data, Data]:
    """Two stores of 60 events on 10 nodes, drawn from different seeds."""
    a = write_tiny_store(tmp_path / "a", events=60, nodes=10, seed=0, t_max=1000)
    b = write_tiny_store(tmp_path / "b", events=60, nodes=10, seed=1, t_max=1000)
    return _data(a), _data(b)


def test_the_store_trained_on_passes_another_is_refused_by_fingerprint(two) -> None:
    a, b = two
    state = {"data": {"store": store_identity(a.events)}}
    assert check_same_data(state, a, "ck") is None
    check_store_first(state, a.cfg, "ck")
    with pytest.raises(SvenError, match=r"^ck was trained on another dataset: ") as err:
        check_same_data(state, b, "ck")
    assert "\n" not in str(err.value)
    with pytest.raises(SvenError, match=r"^ck was trained on another dataset: "):
        check_store_first(state, b.cfg, "ck")
    note = check_same_data(state, b, "ck", other_store=True)
    assert note is not None and note.endswith("as --other-store asks")


def test_a_checkpoint_without_fingerprint_is_judged_by_its_counts(two) -> None:
    a, _ = two
    ranges = {s: list(r) for s, r in a.ranges.items()}
    state = {"data": {"num_nodes": 10, "num_events": 60, "ranges": ranges}}
    assert check_same_data(state, a, "ck") is None
    # Written before the event count was recorded: the rest decides.
    assert check_same_data({"data": {"num_nodes": 10, "ranges": ranges}}, a, "ck") is None
    state = {"data": {"num_nodes": 11, "num_events": 60}, "config": {"data": {"path": "/x"}}}
    with pytest.raises(SvenError) as err:
        check_same_data(state, a, "ck")
    assert str(err.value) == (
        f"ck was trained on another dataset (11 nodes, 60 events, from /x) than "
        f"{a.cfg.data.path} (10 nodes, 60 events); give the store it was trained on"
    )
    assert check_same_data(state, a, "ck", other_store=True) == (
        f"ck was trained on another dataset (11 nodes, 60 events, from /x) than "
        f"{a.cfg.data.path} (10 nodes, 60 events); applied to it as --other-store asks"
    )
