"""Rows read ahead with their batch (``sven.models.readahead``): the prefetch ring's
batches, built a step or two ahead, read their node-state rows then, and each step
reads again those written since. CUDA's fixed-shape step, forced here on the CPU, where
the ring builds ahead on the step's own stream: every row read ahead misses the writes
of the steps between, so only the refresh makes the run equal depth 0's."""

from __future__ import annotations

import pytest
import torch

from sven.models.memory import MemoryState
from tests.integration.test_state_tiers import _ring_run, _same_ring_runs
from tests.integration.test_state_tiers import store as store  # the fixture


@pytest.fixture
def ahead(monkeypatch):
    """The fixed-shape step on the CPU, reading rows ahead wherever it has a ring."""
    monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)
    monkeypatch.setattr("sven.engine.step.reads_ahead", lambda depth, memory, exchange: bool(depth))


@pytest.mark.parametrize("engine", ["copy", "sm"])
@pytest.mark.parametrize("model", ["tgn", "apan"])
def test_rows_read_ahead_give_depth_zeros_run(
    store, tmp_path, ahead, monkeypatch, model: str, engine: str
) -> None:
    """Depth 1 and 2 with rows read ahead: depth 0's parameters after every batch, node
    state and metrics (APAN: mailboxes of two, mail to the neighbours, two commits a
    step). ``copy``: training's rows read by the host thread beside the steps
    (sven.models.copyahead), while they write; ``sm``: by the gather at the build."""
    monkeypatch.setenv("SVEN_READ_AHEAD", engine)
    ref = _ring_run(store, tmp_path / "d0", model, "host", 0)
    assert not ref[2].step.read_ahead
    for d in (1, 2):
        got = _ring_run(store, tmp_path / f"d{d}", model, "host", d)
        tr = got[2]
        assert tr.step.read_ahead and tr.memory.log is not None
        assert (tr.memory.copier is not None) == (engine == "copy")
        # Every training and evaluation batch committed through the log.
        assert int(tr.memory.log.counter) > 50
        _same_ring_runs(ref, got, f"{model} D={d} read ahead")


def test_without_the_refresh_the_run_differs(store, tmp_path, ahead, monkeypatch) -> None:
    """The check of the test above: rows read ahead at the build and used as read (no
    refresh) miss the writes of the step between, and the run is another one. (The
    host thread's reads race with the steps, so whether they miss a write is left to
    chance: tests/unit/test_copyahead.py checks their refresh with a read before a
    commit.)"""
    monkeypatch.setenv("SVEN_READ_AHEAD", "sm")
    ref = _ring_run(store, tmp_path / "d0", "tgn", "host", 0)
    monkeypatch.setattr(MemoryState, "refresh", lambda self, early, nodes: early.rows)
    got = _ring_run(store, tmp_path / "d1", "tgn", "host", 1)
    with pytest.raises(AssertionError, match="parameters differ"):
        _same_ring_runs(ref, got, "no refresh")


def test_a_ring_without_read_ahead_reads_at_the_step(store, tmp_path, monkeypatch) -> None:
    """Node state in host memory on the CPU (not pinned): the ring builds ahead but
    reads no rows; nothing is logged."""
    monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)
    _, _, tr = _ring_run(store, tmp_path / "d1", "tgn", "host", 1)
    assert not tr.step.read_ahead and tr.memory.log is None
    assert all(item.early is None for item in tr.step.ring.slots)
    assert torch.is_tensor(tr.memory.full["memory"])


@pytest.mark.parametrize("engine", ["copy", "sm"])
def test_a_run_resumed_mid_epoch_reads_ahead_from_the_loaded_state(
    tmp_path, ahead, monkeypatch, engine: str
) -> None:
    """Interrupted after a checkpoint mid-epoch and resumed: the node state is loaded
    into the tables directly (no commit), then the ring is filled; the resumed run ends
    as the uninterrupted one, rows read ahead in both (by either engine)."""
    monkeypatch.setenv("SVEN_READ_AHEAD", engine)
    import sven
    from tests.conftest import Interrupted, die_at, write_tiny_store
    from tests.unit.test_components import _overrides as _tiny

    store = write_tiny_store(tmp_path / "store", events=800, nodes=40, seed=3, t_max=10_000)

    def over(out) -> list[str]:
        return _tiny(
            str(store), out, "train.epochs=2", "model.dropout=0.0", "state.device=host",
            "pipeline.prefetch=1", "train.checkpoint_every=4",
        )  # fmt: skip

    whole = sven.Trainer(None, over(tmp_path / "a"))
    want = whole.fit()
    assert whole.step.read_ahead
    tr = sven.Trainer(None, over(tmp_path / "b"))
    tr.add_hook("before_step", die_at(6))
    with pytest.raises(Interrupted):
        tr.fit()
    again = sven.Trainer(None, [*over(tmp_path / "b"), "train.resume=true"]).fit()
    for key in ("val_ap", "val_auc", "test_ap", "test_auc"):
        assert again[key] == want[key], key
