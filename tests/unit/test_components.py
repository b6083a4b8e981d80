"""The trainer's components: each state_dict loads into a fresh component unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sven
from sven.config import load_config
from sven.datasets.store import write_events
from sven.engine.checkpoint import (
    RunCheckpoints,
    Snapshot,
    find_checkpoint,
    load_file,
    read_state,
)
from sven.engine.data import Data
from sven.engine.loop import TrainingState
from sven.engine.optim import Optimizer
from sven.errors import ConfigError
from sven.models import MemoryState, model_from_config
from sven.pipeline.exchange import FixedExchange


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """400 events on 20 nodes with 2 edge features, in time order."""
    rng = np.random.default_rng(1)
    e = 400
    out = tmp_path_factory.mktemp("store") / "small"
    write_events(
        out,
        rng.integers(0, 20, e),
        rng.integers(0, 20, e),
        np.sort(rng.integers(0, 10_000, e)),
        edge_feat=rng.random((e, 2)).astype(np.float32),
        name="small",
    )
    return str(out)


def _overrides(store: str, out: Any, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",
        "quiet=true",
        "train.batch_size=50",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=3",
        "train.threads=1",
        *extra,
    ]


def _same(a: Any, b: Any) -> bool:
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _data(store: str, tmp_path: Any) -> Data:
    cfg = load_config(None, _overrides(store, tmp_path / "run"))
    return Data(
        cfg,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        dtype=torch.float32,
        agree=lambda v: v,
    )


def test_data_state_round_trips_and_refuses_another_partition(store, tmp_path) -> None:
    data = _data(store, tmp_path)
    state = data.state_dict()
    assert state["num_events"] == 400 and state["world_size"] == 1
    assert torch.equal(state["owner"], torch.zeros(20, dtype=torch.int64))
    fresh = _data(store, tmp_path)
    fresh.load_state_dict(state)
    assert _same(fresh.state_dict(), state)
    other = {**state, "owner": state["owner"].clone()}
    other["owner"][3] = 1
    with pytest.raises(ConfigError, match="another partition"):
        fresh.load_state_dict(other)
    with pytest.raises(ConfigError, match="written by 2 ranks"):
        fresh.load_state_dict({**state, "world_size": 2})
    with pytest.raises(ConfigError, match="other data"):
        fresh.load_state_dict({**state, "num_events": 399})


def test_model_state_round_trips(store, tmp_path) -> None:
    data = _data(store, tmp_path)
    lo, hi = data.ranges["train"]
    ev = data.events
    kw = {
        "edge_dim": data.edge_dim,
        "node_dim": data.node_dim,
        "train_events": (ev.src[lo:hi], ev.dst[lo:hi], ev.t[lo:hi]),
    }
    torch.manual_seed(0)
    model = model_from_config(data.cfg.model, **kw)
    torch.manual_seed(1)
    fresh = model_from_config(data.cfg.model, **kw)
    assert not _same(fresh.state_dict(), model.state_dict())
    fresh.load_state_dict(model.state_dict())
    assert _same(fresh.state_dict(), model.state_dict())


def test_memory_shard_state_round_trips() -> None:
    mem = MemoryState(5, 3, 4, mailbox_size=2, time_origin=7.0)
    g = torch.Generator().manual_seed(0)
    mem.memory = torch.randn(5, 3, generator=g)
    mem.last_update = torch.arange(5, dtype=torch.float64)
    mem.mail = torch.randn(5, 2, 4, generator=g)
    mem.mail_ts = torch.rand(5, 2, generator=g, dtype=torch.float64)
    mem.mail_valid = torch.tensor([[True, False]] * 5)
    fresh = MemoryState(5, 3, 4, mailbox_size=2, time_origin=7.0)
    fresh.load_state_dict(mem.state_dict())
    assert _same(fresh.state_dict(), mem.state_dict())
    assert fresh.last_update[4] == 4.0


def test_exchange_counters_round_trip() -> None:
    owner = torch.tensor([0, 1, 0, 1, 1])
    ex = FixedExchange(owner, 1, 2, MemoryState(3, 2, 2))
    ex.counter.add(ids=16, read_rows=40, naive=96)
    state = ex.state_dict()
    assert state == {"ids": 16, "read_rows": 40, "write_rows": 0, "grads": 0, "naive": 96}
    fresh = FixedExchange(owner, 1, 2, MemoryState(3, 2, 2))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    with pytest.raises(KeyError, match="bytes"):
        fresh.load_state_dict({"bytes": 1})


def test_optimizer_state_round_trips_and_takes_this_runs_flags() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = Optimizer(net.parameters(), 0.01, torch.device("cpu"))
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 3)).square().sum().backward()
        opt.step()
    state = opt.state_dict()
    fresh = Optimizer(torch.nn.Linear(3, 2).parameters(), 0.01, torch.device("cpu"))
    fresh.load_state_dict(state)
    assert _same(fresh.state_dict(), state)
    assert float(fresh.state_dict()["state"][0]["step"]) == 2.0
    # A GPU run's state (fused, capturable) loads on CPU with the CPU flags (fused,
    # not capturable).
    gpu = opt.state_dict()
    gpu["param_groups"][0].update(fused=True, capturable=True)
    fresh.load_state_dict(gpu)
    group = fresh.state_dict()["param_groups"][0]
    assert (group["fused"], group["capturable"]) == (True, False)


def test_checkpointer_state_and_files_round_trip(store, tmp_path) -> None:
    cfg = load_config(None, _overrides(store, tmp_path / "run"))
    ck = RunCheckpoints(tmp_path / "run", 3, config=cfg)
    assert ck.state_dict() == {"latest": {"keep_latest_k": 3}, "best": {"keep_latest_k": 1}}
    fresh = RunCheckpoints(tmp_path / "run", 2, config=cfg)
    fresh.load_state_dict(ck.state_dict())
    assert fresh.state_dict() == ck.state_dict()
    state = {"cursor": {"epoch": 1, "next_batch": 2}, "w": torch.arange(3)}
    shard = {"c": torch.tensor([4])}
    node_state = {"m": torch.ones(2, 2)}
    ck.save(ck.latest, 7, Snapshot(state, shard, node_state))
    assert fresh.newest(fresh.latest) == 7
    got = fresh.load(fresh.latest, 7)
    assert _same(got.state, {**state, "config": cfg.to_dict()})
    assert _same(got.shard, {**shard, "rank": 0, "world_size": 1})
    assert _same(got.node_state, node_state) and got.owner is None
    other = load_config(None, _overrides(store, tmp_path / "run", "train.lr=0.5"))
    with pytest.raises(ConfigError, match=r"differing keys: train\.lr"):
        RunCheckpoints(tmp_path / "run", 3, config=other).load(ck.latest, 7)


def test_evaluator_state_is_empty(store, tmp_path) -> None:
    ev = sven.Trainer(None, _overrides(store, tmp_path / "run")).evaluator
    assert ev.state_dict() == {}
    ev.load_state_dict({})
    with pytest.raises(ValueError, match="no state"):
        ev.load_state_dict({"x": 1})


def test_a_trainer_checkpoint_keeps_the_format_2_layout(store, tmp_path) -> None:
    """What the trainer's snapshot becomes on disk is what format 2 documents (and what
    runs before the snapshot wrote): the owner map apart from state.pt (none on one
    process), the node state in nodes/, each rank's small state in rank{r}.pt."""
    run = tmp_path / "run"
    over = _overrides(store, run, "train.epochs=1", "train.max_batches=3")
    sven.Trainer(None, over).fit()
    folder = find_checkpoint(run / "checkpoints")
    state = load_file(folder / "state.pt")
    assert list(state) == [
        "data", "model", "optimizer", "evaluator", "cursor", "progress", "config"
    ]  # fmt: skip
    assert "owner" not in state["data"] and not (folder / "owner.npy").exists()
    assert list(load_file(folder / "rank0.pt")) == ["exchange", "rng", "rank", "world_size"]
    fields = sorted(p.name for p in (folder / "nodes" / "rank0").iterdir())
    assert fields == ["last_update.npy", "mail.npy", "mail_ts.npy", "mail_valid.npy", "memory.npy"]
    best = load_file(find_checkpoint(run / "best") / "state.pt")
    assert list(best) == ["data", "model", "epoch", "memory_phase", "config"]
    assert read_state(find_checkpoint(run)).get("memory_phase") == "val_end"


def test_trainer_state_round_trips_into_a_fresh_trainer(store, tmp_path) -> None:
    """The checkpoint the trainer assembles loads into a new trainer unchanged."""
    over = _overrides(store, tmp_path / "run", "train.epochs=1", "train.max_batches=3")
    tr = sven.Trainer(None, over)
    tr.fit()
    training = TrainingState(1, 0, {"global_step": 4, "history": []})
    snap = tr.state_dict(training)
    state, shard = snap.state, snap.shard
    assert set(state) == {"data", "model", "optimizer", "evaluator", "cursor", "progress"}
    assert set(shard) == {"exchange", "rng"}
    assert float(snap.node_state["memory"].abs().sum()) > 0.0  # trained, not fresh
    # The owner map goes apart from the data identity (the format keeps it apart).
    assert "owner" not in state["data"] and torch.equal(snap.owner, tr.data.owner.cpu())

    def parts(s: Snapshot) -> tuple[Any, ...]:
        return s.state, s.shard, s.node_state, s.owner

    fresh = sven.Trainer(None, [*over, f"out={tmp_path / 'fresh'}"])
    assert not _same(parts(fresh.state_dict(training)), parts(snap))
    fresh.load_state_dict(snap)
    assert _same(parts(fresh.state_dict(training)), parts(snap))
